"""What a target is: its config read without running code (info), and the
hidden-state file format every extract backend writes (hsfile)."""
