"""The evaluate stage's parts, by concern (pipeline/stages/evaluate.py is
its entry point and says how they fit): choice, load, servers, baseline,
measurement (the typed result), measure, results, trackers."""
