"""Process control of a run: its place among the launcher's ranks and the collectives of host numbers, its start
time, helper processes, clean shutdown on signals, exit codes."""
