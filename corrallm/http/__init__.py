"""The server pieces every surface shares: the HTTP/1.1 connection and its request-head
limits (none of it knows an endpoint)."""
