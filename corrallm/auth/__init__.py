"""Who is calling (SPEC §22): keys as named identities held as digests, the caller each
request is served as, and (later) each key's own policy."""
