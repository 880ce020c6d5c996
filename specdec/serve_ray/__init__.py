"""Engine replicas on Ray Serve behind one ingress with the single-process server's API.

Each replica runs the same FastAPI app as `specdec serve` (server/app.py) around its own engine; the
ingress reads a request, picks a replica through the request router (prefix affinity by default) and
relays the replica's answer, streamed or whole. The HTTP layer is written once: the ingress only
forwards bytes, merges /metrics, and turns a replica that died into an error the client can retry.
Ray is imported here and nowhere else (`pip install 'specdec[ray]'`).
"""
