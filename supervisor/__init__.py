"""The supervisor behind ``primerl rl``: starts the four daemons of a run, restarts them by policy, stops them."""
