"""The tools around the library: the `tensorhub` command (`cli`), the demo, the live view
of `tensorhub status --watch`, the child processes the demo starts, and synthetic weights to
publish without a model."""
