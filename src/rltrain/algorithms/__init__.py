"""Controllers (the RL loops) and the pure tensor math they use."""
