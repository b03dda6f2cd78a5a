"""Programs a campaign runs as processes of their own, by path with arguments
(`campaigns.harness.spawn_child(NAME, ...)` starts children/NAME.py). Each has a main(argv)."""
