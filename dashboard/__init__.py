"""The run dashboard (`primerl dashboard`): a read-only web page of a run, live."""
