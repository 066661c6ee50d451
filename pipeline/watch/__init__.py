"""`eagle-panel watch`: a serving vLLM's speculative decoding, read from its
/metrics (issue 54). Read-only: it scrapes the URL the user typed, one
request at a time, and writes nothing.

    scrape.py     the HTTP reads: /metrics, /v1/models (its key from an environment variable)
    figures.py    counters -> a Reading; two Readings -> the interval's figures
                  (counter deltas, a server restart seen as counters going back)
    measured.py   what evaluate measured for the draft served: from a run or an export
"""
