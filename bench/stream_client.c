/* The streaming load generator of bench/overhead.py: many concurrent SSE streams, timed.

       stream_client HOST PORT PATH BODY_FILE CONCURRENCY ROUNDS TOKENS TIMEOUT_S [RAMP_S]

   One thread, epoll. Opens CONCURRENCY keep-alive connections, spread evenly over RAMP_S
   seconds (default 0: all at once); each sends ROUNDS streamed requests (POST PATH, the
   JSON of BODY_FILE), one after the other. The answer
   is decoded (Content-Length or chunked) and split into lines; a line `data: ...` is an
   event, and one that holds `"content"` but not `"role"` is a token (what
   bench/loadgen.py counts). Each line is stamped with the time of the read() that
   completed it. A stream is an error unless it answered 200 with exactly TOKENS tokens.

   Prints one JSON object like loadgen.py's `streams` mode (milliseconds, nearest-rank
   percentiles, plus p90 and max): ttft_* (request sent to first event), gap_* (between
   consecutive tokens of a stream), streams, errors, plus events and tokens received,
   elapsed seconds and this process's own CPU seconds (to show it is not the bottleneck).
   Built by bench/overhead.py with `gcc -O2`; never part of corrallm.
*/
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { HEAD, CHUNK_SIZE, CHUNK_DATA, CHUNK_CRLF, TRAILER, BODY_LEN, BODY_EOF };

typedef struct {
    int fd;
    int rounds_left;
    int connected;
    /* the answer being read */
    int state;
    int status;
    int close_after;
    size_t remaining; /* bytes left of the chunk or of the Content-Length body */
    char head[16384];
    size_t head_len;
    char line[65536];
    size_t line_len;
    char size_line[64];
    size_t size_len;
    /* the stream being timed */
    double t_sent, last_token;
    int got_event, tokens;
    const char *req;
    size_t req_len, req_off;
} Conn;

static double *gaps, *ttfts;
static size_t n_gaps, cap_gaps, n_ttft;
static long events_total, tokens_total;
static int errors, expected_tokens, active, epfd;
static struct sockaddr_in addr;
static char *request;
static size_t request_len;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void push_gap(double g) {
    if (n_gaps == cap_gaps) {
        cap_gaps = cap_gaps ? cap_gaps * 2 : 1 << 16;
        gaps = realloc(gaps, sizeof(double) * cap_gaps);
    }
    gaps[n_gaps++] = g;
}

static int open_conn(Conn *c);

static void start_request(Conn *c) {
    c->state = HEAD;
    c->head_len = c->line_len = c->size_len = 0;
    c->status = 0;
    c->close_after = 0;
    c->got_event = c->tokens = 0;
    c->last_token = 0;
    c->req = request;
    c->req_len = request_len;
    c->req_off = 0;
    c->t_sent = now_s();
    while (c->req_off < c->req_len) {
        ssize_t w = write(c->fd, c->req + c->req_off, c->req_len - c->req_off);
        if (w > 0) {
            c->req_off += (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
            epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
            return;
        } else {
            errors++;
            close(c->fd);
            c->fd = -1;
            active--;
            return;
        }
    }
}

static void finish_stream(Conn *c, double now) {
    (void)now;
    if (c->status != 200 || c->tokens != expected_tokens) errors++;
    c->rounds_left--;
    if (c->rounds_left <= 0) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        c->fd = -1;
        active--;
        return;
    }
    if (c->close_after) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
        if (open_conn(c) < 0) {
            errors += c->rounds_left;
            active--;
        }
        return;
    }
    start_request(c);
}

static void on_line(Conn *c, double now) {
    char *l = c->line;
    size_t n = c->line_len;
    if (n && l[n - 1] == '\r') n--;
    l[n] = 0;
    if (n < 6 || memcmp(l, "data: ", 6) != 0) return;
    events_total++;
    if (!c->got_event) {
        c->got_event = 1;
        if (c->status == 200) ttfts[n_ttft++] = now - c->t_sent;
    }
    if (strstr(l, "\"content\"") && !strstr(l, "\"role\"")) {
        if (c->last_token > 0) push_gap(now - c->last_token);
        c->last_token = now;
        c->tokens++;
        tokens_total++;
    }
}

static void body_bytes(Conn *c, const char *p, size_t n, double now) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n') {
            on_line(c, now);
            c->line_len = 0;
        } else if (c->line_len < sizeof c->line - 1) {
            c->line[c->line_len++] = p[i];
        }
    }
}

/* Consume `n` bytes of the answer; 1 when the answer ended. */
static int feed(Conn *c, const char *p, size_t n, size_t *used, double now) {
    size_t i = 0;
    while (i < n) {
        switch (c->state) {
        case HEAD: {
            if (c->head_len >= sizeof c->head - 1) {
                c->status = -1;
                c->close_after = 1;
                *used = n;
                return 1;
            }
            c->head[c->head_len++] = p[i++];
            if (c->head_len >= 4 && memcmp(c->head + c->head_len - 4, "\r\n\r\n", 4) == 0) {
                c->head[c->head_len] = 0;
                c->status = atoi(c->head + 9);
                char *h = c->head;
                int chunked = 0;
                long length = -1;
                for (char *s = strstr(h, "\r\n"); s && s[2]; s = strstr(s + 2, "\r\n")) {
                    char *k = s + 2;
                    if (strncasecmp(k, "transfer-encoding:", 18) == 0 && strcasestr(k, "chunked"))
                        chunked = 1;
                    else if (strncasecmp(k, "content-length:", 15) == 0)
                        length = atol(k + 15);
                    else if (strncasecmp(k, "connection:", 11) == 0) {
                        char *v = k + 11;
                        while (*v == ' ') v++;
                        if (strncasecmp(v, "close", 5) == 0) c->close_after = 1;
                    }
                }
                if (strncmp(h, "HTTP/1.0", 8) == 0) c->close_after = 1;
                if (chunked) {
                    c->state = CHUNK_SIZE;
                    c->size_len = 0;
                } else if (length >= 0) {
                    c->state = BODY_LEN;
                    c->remaining = (size_t)length;
                    if (!length) {
                        *used = i;
                        return 1;
                    }
                } else {
                    c->state = BODY_EOF;
                    c->close_after = 1;
                }
            }
            break;
        }
        case CHUNK_SIZE:
            if (p[i] == '\n') {
                c->size_line[c->size_len] = 0;
                c->remaining = strtoul(c->size_line, NULL, 16);
                c->size_len = 0;
                c->state = c->remaining ? CHUNK_DATA : TRAILER;
            } else if (c->size_len < sizeof c->size_line - 1) {
                c->size_line[c->size_len++] = p[i];
            }
            i++;
            break;
        case CHUNK_DATA: {
            size_t take = n - i < c->remaining ? n - i : c->remaining;
            body_bytes(c, p + i, take, now);
            i += take;
            c->remaining -= take;
            if (!c->remaining) c->state = CHUNK_CRLF;
            break;
        }
        case CHUNK_CRLF:
            if (p[i++] == '\n') c->state = CHUNK_SIZE;
            break;
        case TRAILER: /* lines until an empty one */
            if (p[i] == '\n') {
                i++;
                if (c->size_len == 0) {
                    *used = i;
                    return 1;
                }
                c->size_len = 0;
            } else {
                if (p[i] != '\r') c->size_len++;
                i++;
            }
            break;
        case BODY_LEN: {
            size_t take = n - i < c->remaining ? n - i : c->remaining;
            body_bytes(c, p + i, take, now);
            i += take;
            c->remaining -= take;
            if (!c->remaining) {
                *used = i;
                return 1;
            }
            break;
        }
        case BODY_EOF:
            body_bytes(c, p + i, n - i, now);
            i = n;
            break;
        }
    }
    *used = n;
    return 0;
}

static void on_readable(Conn *c) {
    char buf[65536];
    for (;;) {
        ssize_t r = read(c->fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && errno == EAGAIN) return;
        double now = now_s();
        if (r <= 0) { /* closed */
            if (c->state == BODY_EOF) {
                if (c->line_len) on_line(c, now);
                c->close_after = 1;
                finish_stream(c, now);
            } else {
                errors += c->rounds_left;
                epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                c->fd = -1;
                active--;
            }
            return;
        }
        size_t off = 0;
        while (off < (size_t)r && c->fd >= 0) {
            size_t used = 0;
            int done = feed(c, buf + off, (size_t)r - off, &used, now);
            off += used;
            if (!done) break;
            int fd_before = c->fd;
            finish_stream(c, now);
            if (c->fd < 0 || c->fd != fd_before) return;
        }
    }
}

static int open_conn(Conn *c) {
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (c->fd < 0) return -1;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->connected = 0;
    if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        close(c->fd);
        c->fd = -1;
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN, .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_ADD, c->fd, &ev);
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void summary(const char *prefix, double *v, size_t n) {
    if (!n) {
        printf("\"%sp50\": null, \"%sp90\": null, \"%sp99\": null, \"%smean\": null, "
               "\"%smax\": null, ",
               prefix, prefix, prefix, prefix, prefix);
        return;
    }
    qsort(v, n, sizeof *v, cmp);
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += v[i];
    double p[3] = {50, 90, 99};
    for (int k = 0; k < 3; k++) {
        long idx = (long)ceil(p[k] / 100.0 * (double)n) - 1;
        if (idx < 0) idx = 0;
        if ((size_t)idx >= n) idx = (long)n - 1;
        printf("\"%sp%g\": %.4f, ", prefix, p[k], v[idx] * 1000);
    }
    printf("\"%smean\": %.4f, \"%smax\": %.4f, ", prefix, sum / (double)n * 1000, prefix,
           v[n - 1] * 1000);
}

int main(int argc, char **argv) {
    if (argc != 9 && argc != 10) {
        fprintf(stderr,
                "usage: %s HOST PORT PATH BODY_FILE CONCURRENCY ROUNDS TOKENS TIMEOUT_S [RAMP_S]\n",
                argv[0]);
        return 2;
    }
    double ramp = argc == 10 ? atof(argv[9]) : 0;
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &addr.sin_addr) != 1) die("address");
    FILE *f = fopen(argv[4], "rb");
    if (!f) die(argv[4]);
    char body[65536];
    size_t body_len = fread(body, 1, sizeof body, f);
    fclose(f);
    int conc = atoi(argv[5]), rounds = atoi(argv[6]);
    expected_tokens = atoi(argv[7]);
    double timeout = atof(argv[8]);
    request = malloc(body_len + 1024);
    request_len = (size_t)sprintf(request,
                                  "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: "
                                  "application/json\r\nAccept: text/event-stream\r\n"
                                  "Content-Length: %zu\r\n\r\n",
                                  argv[3], argv[1], argv[2], body_len);
    memcpy(request + request_len, body, body_len);
    request_len += body_len;
    ttfts = malloc(sizeof(double) * (size_t)conc * (size_t)rounds + 1);

    epfd = epoll_create1(0);
    Conn *conns = calloc((size_t)conc, sizeof(Conn));
    for (int i = 0; i < conc; i++) conns[i].fd = -1;
    double t0 = now_s();
    int opened = 0;
    struct epoll_event evs[512];
    int timed_out = 0;
    while (active > 0 || opened < conc) {
        double now = now_s();
        /* The first streams start spread evenly over RAMP_S (later rounds keep that phase). */
        while (opened < conc && now >= t0 + ramp * opened / conc) {
            Conn *c = &conns[opened++];
            c->rounds_left = rounds;
            if (open_conn(c) < 0) {
                errors += rounds;
                continue;
            }
            active++;
        }
        double left = timeout - (now - t0);
        if (left <= 0) {
            timed_out = 1;
            break;
        }
        int wait_ms = (int)(left * 1000) + 1;
        if (opened < conc) wait_ms = 1;
        int n = epoll_wait(epfd, evs, 512, wait_ms);
        if (n < 0 && errno != EINTR) die("epoll_wait");
        for (int i = 0; i < n; i++) {
            Conn *c = evs[i].data.ptr;
            if (c->fd < 0) continue;
            if (evs[i].events & EPOLLOUT) {
                if (!c->connected) {
                    int err = 0;
                    socklen_t len = sizeof err;
                    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
                    if (err) {
                        errors += c->rounds_left;
                        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
                        close(c->fd);
                        c->fd = -1;
                        active--;
                        continue;
                    }
                    c->connected = 1;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
                    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
                    start_request(c);
                } else if (c->req_off < c->req_len) {
                    ssize_t w = write(c->fd, c->req + c->req_off, c->req_len - c->req_off);
                    if (w > 0) c->req_off += (size_t)w;
                    if (c->req_off >= c->req_len) {
                        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
                        epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
                    }
                }
            }
            if (c->fd >= 0 && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) on_readable(c);
        }
    }
    double elapsed = now_s() - t0;
    if (timed_out) {
        for (int i = 0; i < conc; i++)
            if (conns[i].fd >= 0) errors += conns[i].rounds_left;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                 (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    printf("{");
    summary("ttft_", ttfts, n_ttft);
    summary("gap_", gaps, n_gaps);
    printf("\"streams\": %zu, \"errors\": %d, \"events\": %ld, \"tokens\": %ld, "
           "\"elapsed_s\": %.3f, \"client_cpu_s\": %.3f, \"timed_out\": %s}\n",
           n_ttft, errors, events_total, tokens_total, elapsed, cpu,
           timed_out ? "true" : "false");
    return 0;
}
