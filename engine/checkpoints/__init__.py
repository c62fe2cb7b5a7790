"""ACE-Step 1.5 weights from local files: finding and loading checkpoints, and their key translations."""
