"""parallel/zero/: ZeRO stages 1-3."""
