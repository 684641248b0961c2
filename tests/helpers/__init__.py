"""Helpers shared by kvfsm's tests: real processes, registries, replays and waits. Test modules
import from here and never from one another."""
