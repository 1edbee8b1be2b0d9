"""The DFlash engine: pure PyTorch; imports nothing of deployments/, cluster/, loadtest/ or the CLI."""
