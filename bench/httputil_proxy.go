// The Go standard library's reverse proxy (net/http/httputil), the stack of llama-swap:
// bench/overhead.py's `go-httputil` row, built with Debian's golang-go when present.
//
//	httputil_proxy <listen fast> <upstream fast> <listen stream> <upstream stream>
//
// Keep-alive to the upstreams (idle pool as large as the bench's concurrency), and
// streams flushed as they come (FlushInterval -1), as nginx's `proxy_buffering off`.
package main

import (
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
)

func proxy(upstream string) *httputil.ReverseProxy {
	target, err := url.Parse(upstream)
	if err != nil {
		log.Fatal(err)
	}
	p := httputil.NewSingleHostReverseProxy(target)
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConns = 4096
	transport.MaxIdleConnsPerHost = 4096
	p.Transport = transport
	p.FlushInterval = -1
	return p
}

func main() {
	if len(os.Args) != 5 {
		log.Fatal("usage: httputil_proxy <listen fast> <upstream fast> <listen stream> <upstream stream>")
	}
	mux := func(p *httputil.ReverseProxy) http.Handler {
		m := http.NewServeMux()
		m.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok")) })
		m.Handle("/", p)
		return m
	}
	go func() { log.Fatal(http.ListenAndServe(os.Args[3], mux(proxy(os.Args[4])))) }()
	log.Fatal(http.ListenAndServe(os.Args[1], mux(proxy(os.Args[2]))))
}
