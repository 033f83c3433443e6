/* A streaming upstream that costs next to nothing, for bench/overhead.py.

       stream_upstream PORT EVENTS_FILE DELAY_US

   One thread, epoll, HTTP/1.1 keep-alive. `POST .../chat/completions` (any path ending so)
   answers 200 `text/event-stream` with chunked transfer encoding: the events of
   EVENTS_FILE, one per line as `<flag> <payload>`, each sent as `data: <payload>\n\n` in
   its own HTTP chunk; a flag of 1 means "DELAY_US microseconds after the previous event",
   0 "with the previous one". After the last event, `data: [DONE]` and the last chunk; the
   connection then waits for the next request. `GET /health` answers `{"status":"ok"}`.

   Timers: every stream waits the same delay, so a FIFO of (deadline, connection) stays
   sorted; one timerfd is armed for its head. The request body is read (Content-Length)
   and discarded. Built by bench/overhead.py with `gcc -O2`; never part of corrallm.
*/
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_FDS 65536
#define RING (1 << 16)
#define IN_MAX (1 << 20)

typedef struct {
    char *data;
    size_t len;
    int delayed; /* 1: sent DELAY_US after the previous event */
} Event;

typedef struct {
    int open;
    unsigned gen;      /* bumped on close: stale timer entries are skipped */
    char *in;          /* request bytes not yet handled */
    size_t in_len, in_cap;
    char *out;         /* bytes not yet written */
    size_t out_len, out_off, out_cap;
    int streaming;     /* index of the next event to send, -1 when not streaming */
    int close_after;   /* Connection: close asked for */
    int want_out;      /* EPOLLOUT registered */
} Conn;

typedef struct {
    int fd;
    unsigned gen;
    uint64_t deadline; /* CLOCK_MONOTONIC, ns */
} Timer;

static Event *events;
static int n_events;
static uint64_t delay_ns;
static Conn conns[MAX_FDS];
static Timer ring[RING];
static unsigned ring_head, ring_tail; /* head: next to fire; tail: next free */
static int epfd, tfd;
static uint64_t armed; /* deadline the timerfd is armed for, 0: disarmed */

static const char STREAM_HEAD[] =
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    "Transfer-Encoding: chunked\r\n\r\n";
static const char DONE_TAIL[] = "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
static const char HEALTH[] =
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
    "{\"status\":\"ok\"}";
static const char NOT_FOUND[] =
    "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 21\r\n\r\n"
    "{\"error\":\"not found\"}";
static const char NO_LENGTH[] =
    "HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void load_events(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) die(path);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    int alloc = 0;
    while ((n = getline(&line, &cap, f)) > 0) {
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
        if (n < 3) continue;
        if (n_events == alloc) {
            alloc = alloc ? alloc * 2 : 64;
            events = realloc(events, sizeof(Event) * alloc);
        }
        const char *payload = line + 2;
        size_t plen = (size_t)n - 2;
        /* One HTTP chunk: "<hex>\r\ndata: <payload>\n\n\r\n". */
        size_t body = 6 + plen + 2;
        char *buf = malloc(body + 32);
        int h = sprintf(buf, "%zx\r\n", body);
        memcpy(buf + h, "data: ", 6);
        memcpy(buf + h + 6, payload, plen);
        memcpy(buf + h + 6 + plen, "\n\n\r\n", 4);
        events[n_events].data = buf;
        events[n_events].len = (size_t)h + body + 2;
        events[n_events].delayed = line[0] == '1';
        n_events++;
    }
    free(line);
    fclose(f);
    if (!n_events) {
        fprintf(stderr, "%s: no events\n", path);
        exit(1);
    }
}

static void set_events(int fd, int out) {
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | (out ? EPOLLOUT : 0), .data.fd = fd};
    epoll_ctl(epfd, EPOLL_CTL_MOD, fd, &ev);
    conns[fd].want_out = out;
}

static void close_conn(int fd) {
    Conn *c = &conns[fd];
    if (!c->open) return;
    epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
    c->open = 0;
    c->gen++;
    c->in_len = c->out_len = c->out_off = 0;
    c->streaming = -1;
}

static void append(Conn *c, const char *data, size_t len) {
    if (c->out_off == c->out_len) c->out_off = c->out_len = 0;
    if (c->out_len + len > c->out_cap) {
        if (c->out_off) { /* compact first */
            memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
            c->out_len -= c->out_off;
            c->out_off = 0;
        }
        while (c->out_len + len > c->out_cap) c->out_cap = c->out_cap ? c->out_cap * 2 : 4096;
        c->out = realloc(c->out, c->out_cap);
    }
    memcpy(c->out + c->out_len, data, len);
    c->out_len += len;
}

/* Write what is pending; 0 when the connection had to be closed. */
static int flush(int fd) {
    Conn *c = &conns[fd];
    while (c->out_off < c->out_len) {
        ssize_t w = write(fd, c->out + c->out_off, c->out_len - c->out_off);
        if (w > 0) {
            c->out_off += (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!c->want_out) set_events(fd, 1);
            return 1;
        } else {
            close_conn(fd);
            return 0;
        }
    }
    c->out_off = c->out_len = 0;
    if (c->want_out) set_events(fd, 0);
    return 1;
}

static void arm(void) {
    uint64_t want = ring_head == ring_tail ? 0 : ring[ring_head % RING].deadline;
    if (want == armed) return;
    struct itimerspec its = {0};
    if (want) {
        its.it_value.tv_sec = (time_t)(want / 1000000000u);
        its.it_value.tv_nsec = (long)(want % 1000000000u);
    }
    timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
    armed = want;
}

static void schedule(int fd) {
    if (ring_tail - ring_head >= RING) {
        fprintf(stderr, "timer ring full\n");
        exit(1);
    }
    ring[ring_tail % RING] = (Timer){fd, conns[fd].gen, now_ns() + delay_ns};
    ring_tail++;
}

static void handle_input(int fd);

/* Send the next event and any that go with it; schedule the rest or finish. */
static void advance(int fd) {
    Conn *c = &conns[fd];
    int i = c->streaming;
    do {
        append(c, events[i].data, events[i].len);
        i++;
    } while (i < n_events && !events[i].delayed);
    if (i < n_events) {
        c->streaming = i;
        if (flush(fd)) schedule(fd);
        return;
    }
    append(c, DONE_TAIL, sizeof DONE_TAIL - 1);
    c->streaming = -1;
    if (!flush(fd)) return;
    if (c->close_after) {
        close_conn(fd); /* any unwritten bytes are lost: only after a flush that finished */
        return;
    }
    if (c->in_len) handle_input(fd); /* a pipelined request */
}

static size_t header_value(const char *head, size_t head_len, const char *name, char *out,
                           size_t cap) {
    size_t nlen = strlen(name);
    const char *p = head, *end = head + head_len;
    while (p < end) {
        const char *eol = memmem(p, (size_t)(end - p), "\r\n", 2);
        if (!eol) eol = end;
        if ((size_t)(eol - p) > nlen && p[nlen] == ':' && strncasecmp(p, name, nlen) == 0) {
            const char *v = p + nlen + 1;
            while (v < eol && (*v == ' ' || *v == '\t')) v++;
            size_t n = (size_t)(eol - v);
            if (n >= cap) n = cap - 1;
            memcpy(out, v, n);
            out[n] = 0;
            return n + 1;
        }
        p = eol + 2;
    }
    return 0;
}

/* Handle every complete request in the input buffer (one at a time while streaming). */
static void handle_input(int fd) {
    Conn *c = &conns[fd];
    while (c->open && c->streaming < 0 && c->in_len) {
        char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
        if (!end) return;
        size_t head_len = (size_t)(end - c->in) + 4;
        char value[64];
        size_t body = 0;
        if (header_value(c->in, head_len, "content-length", value, sizeof value)) {
            body = strtoull(value, NULL, 10);
        } else if (header_value(c->in, head_len, "transfer-encoding", value, sizeof value)) {
            append(c, NO_LENGTH, sizeof NO_LENGTH - 1);
            if (flush(fd)) close_conn(fd);
            return;
        }
        if (c->in_len < head_len + body) return; /* the body is still coming */
        c->close_after = header_value(c->in, head_len, "connection", value, sizeof value) &&
                         strcasecmp(value, "close") == 0;
        const char *sp = memchr(c->in, ' ', head_len);
        const char *path = sp ? sp + 1 : c->in;
        const char *path_end = memchr(path, ' ', (size_t)(end - path));
        size_t plen = path_end ? (size_t)(path_end - path) : 0;
        const char *q = memchr(path, '?', plen);
        if (q) plen = (size_t)(q - path);
        int post = strncmp(c->in, "POST ", 5) == 0;
        static const char CHAT[] = "/chat/completions";
        int chat = post && plen >= sizeof CHAT - 1 &&
                   memcmp(path + plen - (sizeof CHAT - 1), CHAT, sizeof CHAT - 1) == 0;
        int health = plen == 7 && memcmp(path, "/health", 7) == 0;
        size_t used = head_len + body;
        memmove(c->in, c->in + used, c->in_len - used);
        c->in_len -= used;
        if (chat) {
            append(c, STREAM_HEAD, sizeof STREAM_HEAD - 1);
            c->streaming = 0;
            advance(fd);
            return;
        }
        append(c, health ? HEALTH : NOT_FOUND, health ? sizeof HEALTH - 1 : sizeof NOT_FOUND - 1);
        if (!flush(fd)) return;
        if (c->close_after) {
            close_conn(fd);
            return;
        }
    }
}

static void on_readable(int fd) {
    Conn *c = &conns[fd];
    for (;;) {
        if (c->in_cap - c->in_len < 4096) {
            if (c->in_cap >= IN_MAX) {
                close_conn(fd);
                return;
            }
            c->in_cap = c->in_cap ? c->in_cap * 2 : 8192;
            c->in = realloc(c->in, c->in_cap);
        }
        ssize_t r = read(fd, c->in + c->in_len, c->in_cap - c->in_len);
        if (r > 0) {
            c->in_len += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        close_conn(fd); /* EOF or error: the client left */
        return;
    }
    handle_input(fd);
}

static void on_timer(void) {
    uint64_t ticks;
    if (read(tfd, &ticks, sizeof ticks) < 0 && errno != EAGAIN) die("timerfd read");
    armed = 0;
    uint64_t now = now_ns();
    while (ring_head != ring_tail && ring[ring_head % RING].deadline <= now) {
        Timer t = ring[ring_head % RING];
        ring_head++;
        Conn *c = &conns[t.fd];
        if (c->open && c->gen == t.gen && c->streaming >= 0) advance(t.fd);
    }
    arm();
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT EVENTS_FILE DELAY_US\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    load_events(argv[2]);
    delay_ns = (uint64_t)strtoull(argv[3], NULL, 10) * 1000u;
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max < MAX_FDS ? rl.rlim_max : MAX_FDS;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    for (int i = 0; i < MAX_FDS; i++) conns[i].streaming = -1;

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (lfd < 0) die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0) die("bind");
    if (listen(lfd, 4096) < 0) die("listen");

    epfd = epoll_create1(0);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    if (epfd < 0 || tfd < 0) die("epoll/timerfd");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &ev);
    ev.data.fd = tfd;
    epoll_ctl(epfd, EPOLL_CTL_ADD, tfd, &ev);
    fprintf(stderr, "stream_upstream: port %d, %d events, delay %llu us\n", port, n_events,
            (unsigned long long)(delay_ns / 1000));

    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(epfd, evs, 256, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == lfd) {
                for (;;) {
                    int cfd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                    if (cfd < 0) break;
                    if (cfd >= MAX_FDS) {
                        close(cfd);
                        continue;
                    }
                    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    Conn *c = &conns[cfd];
                    c->open = 1;
                    c->streaming = -1;
                    c->in_len = c->out_len = c->out_off = 0;
                    c->close_after = c->want_out = 0;
                    struct epoll_event cev = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = cfd};
                    epoll_ctl(epfd, EPOLL_CTL_ADD, cfd, &cev);
                }
            } else if (fd == tfd) {
                on_timer();
            } else if (conns[fd].open) {
                if (evs[i].events & EPOLLOUT) {
                    if (!flush(fd)) continue;
                }
                if (evs[i].events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) on_readable(fd);
            }
        }
        arm(); /* streams started in this batch may have queued the first timer */
    }
}
