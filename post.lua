wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}]]
