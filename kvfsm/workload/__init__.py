"""The workloads that drive kvfsm end to end: ``kvfsm run``, ``kvfsm demo`` and the chaos ranks.

* ``options``: the workload's knobs and flags (``WorkloadOptions``, ``RunOptions``,
  ``DemoOptions``), defined once for both commands.
* ``buffers``: a rank's KV, aux and state buffers as numpy arrays, their NIXL layout, the checks.
* ``peer``: a passive decode rank in its own process (``kvfsm run``, benchmarks, tests).
* ``loop``: the scheduler loop of every rank (run, demo and the chaos ranks) and the phases of a
  room in it (``Phase``).
* ``receiver_steps``: the steps of a decode room in that loop, as a table (``RECEIVER_STEPS``)
  and its driver (``ReceiverSteps``): the demo's decode rank and the chaos decode rank.
* ``peer_run``: ``kvfsm run``'s job: prefill rooms here, the passive decode process there.
* ``plan``, ``ranks``, ``pair``, ``progress``, ``demo_report``: the demo's pieces: the plan
  made from the seed, the two rank processes, starting and stopping them, the progress line,
  the summary.
* ``report``: percentiles, reason classes, sizes and the layout in words.
* ``call_timer``: how long a call kept its caller, less the time the machine's load made it
  wait for a CPU (the chaos ranks' never-block check).
* ``command``, ``interrupts``: the exit statuses every workload command shares, and a teardown
  that Ctrl-C cannot cut short.

Nothing here imports :mod:`kvfsm.chaos`, :mod:`kvfsm.cli` or :mod:`kvfsm.demo`.
"""

#: The package itself exports nothing: its modules are imported by name (``kvfsm.workload.loop``).
__all__: list[str] = []
