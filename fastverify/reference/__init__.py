"""The executable specification: plain torch implementations of every op, written for reading.

Every fast backend is tested against these functions. They take the same normalised arguments as the
compiled ops (see csrc/<op>.cpp for the schemas)."""
