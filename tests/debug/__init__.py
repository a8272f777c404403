"""debug/: flight recorder, hang reports, verify, desyncs."""
