"""`pagevis eval`: lm-eval tasks against `pagevis serve`, per eviction policy, cache budget and dtype."""
