"""session/: the Session and what it composes."""
