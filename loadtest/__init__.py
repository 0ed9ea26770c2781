"""Load tests: locust users (locustfile.py, soak_locustfile.py) and the soak (soak.py)."""
