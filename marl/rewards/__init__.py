"""Where scores come from: reward sources, their weighted sum, judges and TRL interop."""
