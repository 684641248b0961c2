"""What the control channel's wire format costs: codec, loopback throughput, echo latency.

Measured here, side by side in one run:

* handshake - the codec work of one connection's handshake, both sides, without and with a
            secret (nonces, HKDF session keys, key confirmation): a session key costs per
            connection, not per frame;
* session - per frame with a secret: the session codec (session key, sequence number under the
            MAC) against the bare secret (protocol v2's signing) and unsigned;
* codec   - encode + decode of one frame, per typical frame (Heartbeat, RoomMetadata with 64 and
            with 4,096 packed int32 pages, RoomOutcome), without and with a shared secret:
            - floor:    the bare msgspec round trip of the tagged union (no prefix, no envelope,
                        no MAC): the cheapest thing that could carry these frames;
            - kvfsm:    ``FrameCodec.encode`` (length prefix, auth byte, MAC) + ``decode``;
            - envelope: the rejected alternative: a second msgpack layer
                        ``Envelope(frame: bytes, mac: bytes)`` around the same payload (with
                        the same MAC when signed).
            Process CPU time, best of 5.
* tcp     - frames/s through one real loopback TCP connection between **two processes**: a
            child process encodes N RoomOutcome frames one by one and writes each to an asyncio
            stream (drain every 256); the parent reads with ``FrameReader``. From the first byte
            read to the N-th frame decoded, plus the reader's CPU per frame.
* echo    - round trip of RoomAbort -> RoomSettled over loopback TCP between two processes:
            the parent sends a RoomAbort and waits; the child's FrameReader decodes it and
            answers RoomSettled for the same (room, generation). Median and p99 over N pings.

Both processes run uvloop when it is installed (the engine's loop does), else asyncio.

Run: ``python benchmarks/control.py`` (``--json`` for one JSON object).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvfsm.control._codec import FrameCodec, FrameReader
from kvfsm.control._frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    AnyFrame,
    Frame,
    FrameError,
    Heartbeat,
    Hello,
    RoomAbort,
    RoomMetadata,
    RoomOutcome,
    RoomSettled,
)

SECRET = b"benchmark secret, 32 bytes long!"
PAGES_64 = bytes(range(256))  # 64 int32
PAGES_4096 = PAGES_64 * 64
TYPICAL: dict[str, Frame] = {
    "Heartbeat": Heartbeat(123_456),
    "RoomMetadata 64 pages": RoomMetadata(2**62 + 17, 3, PAGES_64, 12),
    "RoomMetadata 4096 pages": RoomMetadata(2**62 + 17, 3, PAGES_4096, 12),
    "RoomOutcome": RoomOutcome(2**62 + 17, 3, 4),
}


def _use_uvloop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


# -- codec ---------------------------------------------------------------------------------------


class Envelope(msgspec.Struct, array_like=True):
    frame: bytes
    mac: bytes = b""


def _per_call_us(fn: Callable[[], object], budget_s: float = 0.04, runs: int = 5) -> float:
    n, start = 0, time.process_time()
    while time.process_time() - start < budget_s / 4:
        fn()
        n += 1
    best = float("inf")
    for _ in range(runs):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n)
    return best * 1e6


def codec_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(AnyFrame)
    env_encoder = msgspec.msgpack.Encoder()
    env_decoder = msgspec.msgpack.Decoder(Envelope)
    for name, frame in TYPICAL.items():
        for secret in (None, SECRET):
            codec = FrameCodec(secret)
            wire = codec.encode(frame)
            assert codec.decode(wire[4:]) == frame
            payload = encoder.encode(frame)

            def floor(frame: Frame = frame) -> object:
                return decoder.decode(encoder.encode(frame))

            def kvfsm(frame: Frame = frame, codec: FrameCodec = codec) -> object:
                return codec.decode(memoryview(codec.encode(frame))[4:])

            keyed = None if secret is None else hmac.new(secret, digestmod=hashlib.sha256)

            def envelope(frame: Frame = frame, keyed: Any = keyed) -> object:
                # Same MAC computation as FrameCodec (a copy of the keyed state per frame).
                inner = encoder.encode(frame)
                mac = b""
                if keyed is not None:
                    h = keyed.copy()
                    h.update(inner)
                    mac = h.digest()
                body = env_encoder.encode(Envelope(inner, mac))
                wire = len(body).to_bytes(4, "big") + body
                env = env_decoder.decode(memoryview(wire)[4:])
                if keyed is not None:
                    h = keyed.copy()
                    h.update(env.frame)
                    if not hmac.compare_digest(h.digest(), env.mac):
                        raise FrameError("bad MAC", None, True)
                return decoder.decode(env.frame)

            def encode_only(frame: Frame = frame, codec: FrameCodec = codec) -> object:
                return codec.encode(frame)

            def decode_only(body: bytes = wire[4:], codec: FrameCodec = codec) -> object:
                return codec.decode(body)

            rows.append(
                {
                    "frame": name,
                    "signed": secret is not None,
                    "wire_bytes": len(wire),
                    "payload_bytes": len(payload),
                    "floor_us": _per_call_us(floor),
                    "encode_us": _per_call_us(encode_only),
                    "decode_us": _per_call_us(decode_only),
                    "kvfsm_us": _per_call_us(kvfsm),
                    "envelope_us": _per_call_us(envelope),
                }
            )
    return rows


def session_rows() -> list[dict[str, Any]]:
    """Per frame, after the handshake with a secret: the connection's SessionCodec (session key,
    sequence number under the MAC) against FrameCodec signed with the bare secret (v2's frames)
    and unsigned: what the freshness costs per frame."""
    rows = []
    for name, frame in TYPICAL.items():
        signed, plain = FrameCodec(SECRET), FrameCodec()
        nonces = secrets.token_bytes(NONCE_BYTES), secrets.token_bytes(NONCE_BYTES)
        sender = signed.session("decode", nonces[0], nonces[1])
        receiver = signed.session("prefill", nonces[1], nonces[0])

        def session(frame: Frame = frame, tx: Any = sender, rx: Any = receiver) -> object:
            return rx.decode(memoryview(tx.encode(frame))[4:])

        def bare(frame: Frame = frame, codec: FrameCodec = signed) -> object:
            return codec.decode(memoryview(codec.encode(frame))[4:])

        def unsigned(frame: Frame = frame, codec: FrameCodec = plain) -> object:
            return codec.decode(memoryview(codec.encode(frame))[4:])

        rows.append(
            {
                "frame": name,
                "session_us": _per_call_us(session),
                "secret_only_us": _per_call_us(bare),
                "unsigned_us": _per_call_us(unsigned),
            }
        )
    return rows


def handshake_rows() -> list[dict[str, Any]]:
    """The codec work of one connection's handshake, both sides in one process (no sockets, no
    NIXL): two Hellos encoded and decoded; with a secret also two nonces, two session-key
    derivations (HKDF-SHA256) and the two key-confirmation frames. Process CPU per handshake."""
    layout = b"\x81\xa1k" + bytes(2048)  # a layout summary's size
    metadata = bytes(8192)  # NIXL agent metadata (UCX, DRAM): a few KiB
    rows = []
    for secret in (None, SECRET):
        codec = FrameCodec(secret)

        def handshake(codec: FrameCodec = codec, secret: bytes | None = secret) -> object:
            nonce_d = secrets.token_bytes(NONCE_BYTES) if secret else b""
            nonce_p = secrets.token_bytes(NONCE_BYTES) if secret else b""
            hello_d = Hello(PROTOCOL_VERSION, "decode", 0, "d", metadata, layout, 1, 2000, nonce_d)
            hello_p = Hello(PROTOCOL_VERSION, "prefill", 0, "p", b"", b"", 2, 0, nonce_p)
            got_d = codec.decode(memoryview(codec.encode(hello_d))[4:])
            got_p = codec.decode(memoryview(codec.encode(hello_p))[4:])
            if secret is None:
                return got_d, got_p
            dec = codec.session("decode", nonce_d, nonce_p)
            pre = codec.session("prefill", nonce_p, nonce_d)
            pre.decode(memoryview(dec.encode(Heartbeat(0)))[4:])
            return dec.decode(memoryview(pre.encode(Heartbeat(0)))[4:])

        rows.append({"signed": secret is not None, "handshake_us": _per_call_us(handshake)})
    return rows


# -- two processes over loopback TCP ------------------------------------------------------------


def _child(port: int, mode: str, count: int, signed: bool) -> None:
    _use_uvloop()
    asyncio.run(_child_main(port, mode, count, SECRET if signed else None))


async def _child_main(port: int, mode: str, count: int, secret: bytes | None) -> None:
    codec = FrameCodec(secret)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if mode == "send":
        for i in range(count):
            writer.write(codec.encode(RoomOutcome(i, 1, 4)))
            if i % 256 == 255:
                await writer.drain()
        await writer.drain()
        await reader.read(1)  # wait for the parent to finish reading
    else:  # echo: answer every RoomAbort with RoomSettled
        frames = FrameReader(codec)
        while data := await reader.read(65_536):
            for item in frames.feed(data):
                if isinstance(item, RoomAbort):
                    writer.write(codec.encode(RoomSettled(item.room, item.generation)))
                elif isinstance(item, FrameError):
                    raise item
    writer.close()
    await writer.wait_closed()


async def _with_child(
    mode: str, count: int, signed: bool, body: Callable[..., Any]
) -> dict[str, Any]:
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accepted.put((r, w))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_child, args=(port, mode, count, signed))
    proc.start()
    try:
        reader, writer = await asyncio.wait_for(accepted.get(), 60)
        result: dict[str, Any] = await body(reader, writer, FrameCodec(SECRET if signed else None))
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
        if proc.is_alive():
            proc.kill()
    return result


async def tcp_throughput(count: int, signed: bool) -> dict[str, Any]:
    async def body(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec
    ) -> dict[str, Any]:
        frames = FrameReader(codec)
        got = bytes_in = 0
        data = await reader.read(65_536)
        start, cpu = time.perf_counter(), time.process_time()
        while True:
            bytes_in += len(data)
            for item in frames.feed(data):
                if isinstance(item, FrameError):
                    raise item
                got += 1
            if got >= count:
                break
            data = await reader.read(65_536)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        writer.write(b"x")
        return {
            "signed": signed,
            "frames": got,
            "frames_per_s": got / elapsed,
            "mb_per_s": bytes_in / elapsed / 1e6,
            "reader_cpu_us_per_frame": cpu / got * 1e6,
        }

    return await _with_child("send", count, signed, body)


async def echo_latency(pings: int, signed: bool) -> dict[str, Any]:
    async def body(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec
    ) -> dict[str, Any]:
        frames = FrameReader(codec)
        rtts: list[int] = []
        warmup = max(50, pings // 10)
        for i in range(warmup + pings):
            abort = RoomAbort(2**62 + i, 7, "aborted by the scheduler")
            start = time.perf_counter_ns()
            writer.write(codec.encode(abort))
            reply: list[Frame | FrameError] = []
            while not reply:
                reply = frames.feed(await reader.read(65_536))
            rtt = time.perf_counter_ns() - start
            if reply != [RoomSettled(abort.room, abort.generation)]:
                raise RuntimeError(f"unexpected reply {reply!r}")
            if i >= warmup:
                rtts.append(rtt)
        rtts.sort()
        return {
            "signed": signed,
            "pings": len(rtts),
            "median_us": statistics.median(rtts) / 1e3,
            "p99_us": rtts[int(0.99 * (len(rtts) - 1))] / 1e3,
            "max_us": rtts[-1] / 1e3,
        }

    return await _with_child("echo", pings, signed, body)


# -- report --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--frames", type=int, default=100_000, help="frames per throughput run")
    parser.add_argument("--pings", type=int, default=2_000, help="round trips per echo run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    loop_kind = _use_uvloop()
    started = time.perf_counter()
    codec = codec_rows()
    handshake = handshake_rows()
    session = session_rows()
    tcp = [asyncio.run(tcp_throughput(args.frames, signed)) for signed in (False, True)]
    echo = [asyncio.run(echo_latency(args.pings, signed)) for signed in (False, True)]
    result = {
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "loop": loop_kind,
        "cpus": os.cpu_count(),
        "codec": codec,
        "handshake": handshake,
        "session": session,
        "tcp": tcp,
        "echo": echo,
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(result))
        return 0

    print(
        f"kvfsm control frames: python {result['python']}, msgspec {result['msgspec']}, "
        f"{loop_kind}, {result['cpus']} CPUs"
    )
    print()
    print("codec: encode + decode of one frame, us (process CPU, best of 5)")
    header = (
        f"{'frame':<24} {'MAC':<4} {'wire B':>7} {'floor':>7} {'encode':>7} {'decode':>7} "
        f"{'kvfsm':>7} {'x floor':>7} {'envelope':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in codec:
        print(
            f"{row['frame']:<24} {'yes' if row['signed'] else 'no':<4} {row['wire_bytes']:>7} "
            f"{row['floor_us']:>7.2f} {row['encode_us']:>7.2f} {row['decode_us']:>7.2f} "
            f"{row['kvfsm_us']:>7.2f} {row['kvfsm_us'] / row['floor_us']:>7.1f} "
            f"{row['envelope_us']:>8.2f}"
        )
    print()
    print("handshake: codec work of one connection, both sides (no sockets, no NIXL), us")
    plain, signed = handshake[0]["handshake_us"], handshake[1]["handshake_us"]
    print(f"  no secret {plain:8.1f}   secret {signed:8.1f}   ratio {signed / plain:.2f}")
    print()
    print("per frame with a secret: session key + sequence vs the bare secret vs unsigned, us")
    for row in session:
        print(
            f"  {row['frame']:<24} session {row['session_us']:6.2f}  secret only "
            f"{row['secret_only_us']:6.2f}  unsigned {row['unsigned_us']:6.2f}  "
            f"(x{row['session_us'] / row['secret_only_us']:.2f} of secret only)"
        )
    print()
    print("tcp: RoomOutcome frames through one loopback connection (child sends, parent reads)")
    for row in tcp:
        print(
            f"  MAC {'yes' if row['signed'] else 'no ':<3}  {row['frames_per_s']:>10,.0f} frames/s"
            f"  {row['mb_per_s']:>6.1f} MB/s  reader CPU {row['reader_cpu_us_per_frame']:.2f} "
            f"us/frame  ({row['frames']:,} frames)"
        )
    print()
    print("echo: RoomAbort -> RoomSettled round trip over loopback (two processes)")
    for row in echo:
        print(
            f"  MAC {'yes' if row['signed'] else 'no ':<3}  median {row['median_us']:>7.1f} us"
            f"  p99 {row['p99_us']:>7.1f} us  max {row['max_us']:>8.1f} us  "
            f"({row['pings']:,} pings)"
        )
    print()
    print(f"total {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
