"""components/: what strategies and the session share."""
