"""Fault tools and campaigns (kvfsm.chaos)."""
