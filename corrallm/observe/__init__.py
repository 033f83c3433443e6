"""Seeing what happens (SPEC §21): the request in hand (`context`), live requests with
cancel (`live`), request and response captures (`captures`)."""
