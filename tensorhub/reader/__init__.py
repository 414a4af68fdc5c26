"""The reader side of the protocol: one pull as messages, free of I/O."""
