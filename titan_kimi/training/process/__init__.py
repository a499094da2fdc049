"""Process control of a run: helper processes, clean shutdown on signals, exit codes."""
