"""pdserve's services: the router, the prefill pool and the decode pool (one package each), and what the two
worker kinds share (``services.worker``)."""
