"""What every role shares: config loading, logging set-up, socket factories. Imports neither torch nor vLLM."""
