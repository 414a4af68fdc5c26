"""The tools around the library: the `tensorhub` command, the demo, the chaos run, the live
view of `tensorhub status --watch`, and child processes stopped by PID."""
