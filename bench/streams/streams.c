/* The many-streams workload's load generator and fake decode server, in C so neither fills its core first.
 *
 * Built by bench/streams/cstreams.py (cc -O2) into a cache directory; see that module for how the bench
 * drives it. One epoll loop per process, non-blocking sockets, HTTP/1.1 keep-alive.
 *
 *   streams server --port P --events E --duration S
 *     A fake D: GET /health (200), GET /version; POST /v1/chat/completions or /v1/completions with
 *     "stream":true answers a chunked text/event-stream of E events, the first at once and the
 *     others every S/(E-1) seconds, one chunk each, "data: [DONE]" and the last chunk riding with
 *     the last event; any other completion is a small JSON answer. Anything else: 404.
 *     The first line on stdout is "listening on PORT".
 *
 *   streams client --port P [--prefill-port Q] --clients N --seconds S --ramp R --drain D
 *                  --events E --body FILE [--prefill-body FILE] --out PREFIX
 *     N clients, each one keep-alive connection (two with --prefill-port), started evenly over
 *     R seconds, each a closed loop of streams until R+S seconds have passed. The body file is
 *     the stream request; "@ID@" in it becomes a request id of its own per stream, "@PARAMS@"
 *     the kv_transfer_params object of P's answer to the prefill leg (--prefill-body, sent to
 *     port Q first). Streams started after the ramp are measured: PREFIX.ttft gets (start offset
 *     in the window, time to first event) per stream, PREFIX.gaps the gap before every event
 *     (0 for the second and later events of one read), both as native doubles. One line of JSON
 *     on stdout: counts, errors, statuses, this process's CPU seconds and wall time.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXFD 65536
#define MAX_ERRORS 5

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) die("realloc");
    return q;
}

typedef struct { char *p; size_t len, cap; } buf_t;

static void buf_add(buf_t *b, const char *d, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 256;
        b->p = xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->len, d, n);
    b->len += n;
}

static void buf_drop(buf_t *b, size_t n) {
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

typedef struct { double *p; size_t len, cap; } dvec;

static void dvec_add(dvec *v, double x) {
    if (v->len == v->cap) {
        v->cap = v->cap * 2 + 1024;
        v->p = xrealloc(v->p, v->cap * sizeof(double));
    }
    v->p[v->len++] = x;
}

static void raise_nofile(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
        r.rlim_cur = r.rlim_max;
        setrlimit(RLIMIT_NOFILE, &r);
    }
}

static int epfd;

static void ep_set(int fd, unsigned events, int op) {
    struct epoll_event ev = {.events = events, .data.fd = fd};
    if (epoll_ctl(epfd, op, fd, &ev) < 0 && op != EPOLL_CTL_DEL) die("epoll_ctl");
}

/* Writes all of d, or keeps the rest in out and waits for EPOLLOUT; -1: the peer is gone. */
static int send_all(int fd, buf_t *out, const char *d, size_t n) {
    if (out->len) {
        buf_add(out, d, n);
        return 0;
    }
    ssize_t w = send(fd, d, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
        if (errno != EAGAIN) return -1;
        w = 0;
    }
    if ((size_t)w < n) {
        buf_add(out, d + w, n - (size_t)w);
        ep_set(fd, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
    }
    return 0;
}

static int flush_out(int fd, buf_t *out) {
    while (out->len) {
        ssize_t w = send(fd, out->p, out->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) return errno == EAGAIN ? 0 : -1;
        buf_drop(out, (size_t)w);
    }
    ep_set(fd, EPOLLIN, EPOLL_CTL_MOD);
    return 0;
}

static const char *arg(int argc, char **argv, const char *name, const char *fallback) {
    for (int i = 2; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    if (!fallback) {
        fprintf(stderr, "missing %s\n", name);
        exit(2);
    }
    return fallback;
}

static char *fmt(size_t *len, const char *f, ...) {
    va_list ap;
    va_start(ap, f);
    char *s = NULL;
    int n = vasprintf(&s, f, ap);
    va_end(ap);
    if (n < 0) die("vasprintf");
    *len = (size_t)n;
    return s;
}

static long header_value(const char *head, size_t hlen, const char *name) {
    size_t nl = strlen(name);
    const char *p = head, *end = head + hlen;
    while (p && p < end) {
        if (strncasecmp(p, name, nl) == 0) return strtol(p + nl, NULL, 10);
        p = memchr(p, '\n', (size_t)(end - p));
        if (p) p++;
    }
    return -1;
}

/* ------------------------------------------------------------------ server */

typedef struct {
    buf_t in, out;
    int streaming, next;
} sconn;

typedef struct { double due; int fd; unsigned gen; } tick;

static sconn *sconns[MAXFD];
static unsigned gens[MAXFD];
static tick *queue;
static size_t q_head, q_len, q_cap;
static char **chunks;
static size_t *chunk_len;
static int nchunks;
static double interval;
static char *json_answer, *version_answer, *not_found_answer;
static size_t json_len, version_len, not_found_len;
static const char HEALTH[] = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";

/* Every stream has the same interval, so ticks are due in the order they are queued: a FIFO. */
static void q_push(double due, int fd) {
    if (q_len == q_cap) {
        size_t cap = q_cap * 2 + 4096;
        tick *n = malloc(cap * sizeof(tick));
        if (!n) die("malloc");
        for (size_t i = 0; i < q_len; i++) n[i] = queue[(q_head + i) % q_cap];
        free(queue);
        queue = n, q_head = 0, q_cap = cap;
    }
    queue[(q_head + q_len++) % q_cap] = (tick){due, fd, gens[fd]};
}

static void s_close(int fd) {
    sconn *c = sconns[fd];
    if (!c) return;
    ep_set(fd, 0, EPOLL_CTL_DEL);
    close(fd);
    free(c->in.p);
    free(c->out.p);
    free(c);
    sconns[fd] = NULL;
    gens[fd]++;
}

static char *http_json(size_t *len, const char *status, const char *body) {
    return fmt(len, "HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n%s",
               status, strlen(body), body);
}

static void build_answers(int events, double duration) {
    nchunks = events;
    interval = events > 1 ? duration / (events - 1) : 0;
    chunks = calloc((size_t)events, sizeof(char *));
    chunk_len = calloc((size_t)events, sizeof(size_t));
    for (int i = 0; i < events; i++) {
        char ev[512];
        int n = snprintf(ev, sizeof ev,
            "data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,"
            "\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok%d\"},"
            "\"logprobs\":null,\"finish_reason\":%s}]}\n\n", i, i == events - 1 ? "\"length\"" : "null");
        const char *head = i == 0 ? "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                    "transfer-encoding: chunked\r\n\r\n" : "";
        const char *tail = i == events - 1 ? "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" : "";
        chunks[i] = fmt(&chunk_len[i], "%s%x\r\n%s\r\n%s", head, n, ev, tail);
    }
    json_answer = http_json(&json_len, "200 OK",
        "{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion\",\"created\":0,\"model\":\"sim-model\","
        "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\" tok\"},"
        "\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,"
        "\"total_tokens\":9}}");
    version_answer = http_json(&version_len, "200 OK", "{\"version\":\"0.33.0\"}");
    not_found_answer = http_json(&not_found_len, "404 Not Found",
        "{\"error\":{\"message\":\"not found\",\"type\":\"NotFoundError\",\"param\":null,\"code\":404}}");
}

/* Answers one request; 1 when a stream began (later requests wait for its end), -1: closed. */
static int s_answer(int fd, sconn *c, const char *req, const char *body, size_t blen) {
    int get = strncmp(req, "GET ", 4) == 0, post = strncmp(req, "POST ", 5) == 0;
    const char *path = req + (get ? 4 : post ? 5 : 0);
    int r;
    if (get && strncmp(path, "/health ", 8) == 0) {
        r = send_all(fd, &c->out, HEALTH, sizeof HEALTH - 1);
    } else if (get && strncmp(path, "/version ", 9) == 0) {
        r = send_all(fd, &c->out, version_answer, version_len);
    } else if (post && (strncmp(path, "/v1/chat/completions ", 21) == 0 ||
                        strncmp(path, "/v1/completions ", 16) == 0)) {
        if (memmem(body, blen, "\"stream\":true", 13) || memmem(body, blen, "\"stream\": true", 14)) {
            r = send_all(fd, &c->out, chunks[0], chunk_len[0]);
            if (nchunks > 1 && r == 0) {
                c->streaming = 1, c->next = 1;
                q_push(now_s() + interval, fd);
                return 1;
            }
        } else {
            r = send_all(fd, &c->out, json_answer, json_len);
        }
    } else {
        r = send_all(fd, &c->out, not_found_answer, not_found_len);
    }
    if (r < 0) s_close(fd);
    return r;
}

static void s_requests(int fd) {
    sconn *c = sconns[fd];
    while (c && !c->streaming) {
        char *end = memmem(c->in.p, c->in.len, "\r\n\r\n", 4);
        if (!end) return;
        size_t hlen = (size_t)(end - c->in.p) + 4;
        long clen = header_value(c->in.p, hlen, "content-length:");
        if (clen < 0) clen = 0;
        if (c->in.len < hlen + (size_t)clen) return;
        if (s_answer(fd, c, c->in.p, c->in.p + hlen, (size_t)clen) < 0) return;
        buf_drop(&c->in, hlen + (size_t)clen);
    }
}

static void s_ticks(double now) {
    while (q_len && queue[q_head].due <= now) {
        tick t = queue[q_head];
        q_head = (q_head + 1) % q_cap, q_len--;
        sconn *c = sconns[t.fd];
        if (!c || gens[t.fd] != t.gen || !c->streaming) continue;
        if (send_all(t.fd, &c->out, chunks[c->next], chunk_len[c->next]) < 0) {
            s_close(t.fd);
            continue;
        }
        if (++c->next < nchunks) {
            q_push(t.due + interval, t.fd);
        } else {
            c->streaming = 0;
            s_requests(t.fd);
        }
    }
}

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
    if (listen(fd, 4096) < 0) die("listen");
    socklen_t l = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &l);
    printf("listening on %d\n", ntohs(a.sin_port));
    fflush(stdout);
    return fd;
}

static void s_accept(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
        if (fd < 0) return;
        if (fd >= MAXFD) {
            close(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        sconns[fd] = calloc(1, sizeof(sconn));
        ep_set(fd, EPOLLIN, EPOLL_CTL_ADD);
    }
}

static void s_read(int fd) {
    sconn *c = sconns[fd];
    char b[65536];
    for (;;) {
        ssize_t n = recv(fd, b, sizeof b, 0);
        if (n > 0) {
            buf_add(&c->in, b, (size_t)n);
            if ((size_t)n < sizeof b) break;
            continue;
        }
        if (n < 0 && errno == EAGAIN) break;
        s_close(fd);
        return;
    }
    s_requests(fd);
}

static volatile sig_atomic_t stopping;
static void on_term(int sig) { (void)sig; stopping = 1; }

static int server_main(int argc, char **argv) {
    build_answers(atoi(arg(argc, argv, "--events", "64")), atof(arg(argc, argv, "--duration", "2")));
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    epfd = epoll_create1(0);
    int lfd = listen_on(atoi(arg(argc, argv, "--port", "0")));
    ep_set(lfd, EPOLLIN, EPOLL_CTL_ADD);
    struct epoll_event evs[512];
    while (!stopping) {
        int timeout = 100;
        if (q_len) {
            double wait = queue[q_head].due - now_s();
            timeout = wait <= 0 ? 0 : (int)(wait * 1000) + 1;
        }
        int n = epoll_wait(epfd, evs, 512, timeout);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == lfd) {
                s_accept(lfd);
                continue;
            }
            if (sconns[fd] && (evs[i].events & EPOLLOUT) && flush_out(fd, &sconns[fd]->out) < 0) s_close(fd);
            if (sconns[fd] && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) s_read(fd);
        }
        s_ticks(now_s());
    }
    return 0;
}

/* ------------------------------------------------------------------ client */

enum { HEAD, CHUNK_SIZE, CHUNK_DATA, CHUNK_CRLF, TRAILER, BODY_CL };
enum { DECODE, PREFILL };

typedef struct client client;

typedef struct {
    int fd, leg, connected, state, closing;
    long remaining;
    client *cl;
    buf_t in, out;
} cconn;

struct client {
    int index, active, closed, status, events, count;
    double t0, first, last, now;
    cconn *conn[2];
    buf_t prefill; /* P's answer */
    char tail[8];  /* the last bytes of the stream's body, de-chunked */
    int tail_len;
    dvec gaps;
};

static cconn *cconns[MAXFD];
static client *clients;
static int nclients, nevents, open_clients, two_legs;
static double started, measure_from, stop_at;
static char *body_tpl, *prefill_body;
static size_t prefill_len;
static dvec ttfts, gaps_all;
static long streams_ok, errors, events_total, reconnects;
#define BACKOFF 1.0 /* seconds before a client whose connection was closed connects again */
static int *rq;     /* clients to reconnect, in the order they are due (one backoff each: a FIFO) */
static double *rq_at;
static size_t rq_head, rq_len;
static char first_errors[MAX_ERRORS][200];
static int statuses[600];

/* An error of a measured stream (or of a connection, which has no stream yet). */
static void error_at(client *cl, const char *f, ...) {
    if (cl->t0 != 0 && cl->t0 < measure_from) return;
    if (errors < MAX_ERRORS) {
        va_list ap;
        va_start(ap, f);
        vsnprintf(first_errors[errors], sizeof first_errors[0], f, ap);
        va_end(ap);
    }
    errors++;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die(path);
    buf_t b = {0};
    char tmp[4096];
    size_t n;
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) buf_add(&b, tmp, n);
    fclose(f);
    buf_add(&b, "", 1);
    *len = b.len - 1;
    return b.p;
}

/* The template with key replaced by value. */
static void fill(buf_t *out, const char *tpl, const char *key, const char *value, size_t vlen) {
    const char *at = strstr(tpl, key);
    if (!at) {
        buf_add(out, tpl, strlen(tpl));
        return;
    }
    buf_add(out, tpl, (size_t)(at - tpl));
    buf_add(out, value, vlen);
    buf_add(out, at + strlen(key), strlen(at + strlen(key)));
}

static void c_lost(cconn *c, const char *why);

static void c_send(client *cl, int leg, const char *body, size_t blen) {
    char head[256];
    int n = snprintf(head, sizeof head, "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
                     "content-type: application/json\r\ncontent-length: %zu\r\n\r\n", blen);
    cconn *c = cl->conn[leg];
    buf_t msg = {0};
    buf_add(&msg, head, (size_t)n);
    buf_add(&msg, body, blen);
    c->state = HEAD;
    int r = send_all(c->fd, &c->out, msg.p, msg.len);
    free(msg.p);
    if (r < 0) c_lost(c, "reset on send");
}

static void c_finish(client *cl);

static void c_start(client *cl) {
    double now = now_s();
    if (now >= stop_at || !cl->conn[DECODE]->connected || (two_legs && !cl->conn[PREFILL]->connected)) {
        c_finish(cl);
        return;
    }
    cl->active = 1, cl->count++;
    cl->t0 = now, cl->first = 0, cl->last = 0, cl->status = 0, cl->events = 0, cl->tail_len = 0;
    cl->gaps.len = 0, cl->prefill.len = 0;
    if (two_legs) {
        c_send(cl, PREFILL, prefill_body, prefill_len);
        return;
    }
    char id[64];
    int n = snprintf(id, sizeof id, "bench-%d-%d", cl->index, cl->count);
    buf_t body = {0};
    fill(&body, body_tpl, "@ID@", id, (size_t)n);
    c_send(cl, DECODE, body.p, body.len);
    free(body.p);
}

static void c_decode_leg(client *cl) {
    buf_add(&cl->prefill, "", 1);
    char *at = strstr(cl->prefill.p, "\"kv_transfer_params\":");
    char *start = at ? strchr(at + 21, '{') : NULL, *p = start;
    int depth = 0;
    for (; p && *p; p++) {
        if (*p == '{') depth++;
        if (*p == '}' && --depth == 0) break;
    }
    if (cl->status != 200 || !p || !*p) {
        if (cl->status > 0 && cl->status < 600 && cl->t0 >= measure_from) statuses[cl->status]++;
        error_at(cl, "prefill answered %d", cl->status);
        cl->active = 0;
        if (!cl->conn[PREFILL]->closing) c_start(cl);
        return;
    }
    buf_t body = {0};
    fill(&body, body_tpl, "@PARAMS@", start, (size_t)(p - start + 1));
    cl->status = 0;
    c_send(cl, DECODE, body.p, body.len);
    free(body.p);
}

static void c_stream_done(client *cl) {
    int expected = nevents + 1; /* and [DONE] */
    cl->active = 0;
    if (cl->status != 200 || cl->events != expected || !memmem(cl->tail, (size_t)cl->tail_len, "[DONE]", 6)) {
        if (cl->status > 0 && cl->status < 600 && (cl->t0 >= measure_from)) statuses[cl->status]++;
        error_at(cl, "answer %d with %d events", cl->status, cl->events);
    } else if (cl->t0 >= measure_from) {
        streams_ok++;
        dvec_add(&ttfts, cl->t0 - measure_from);
        dvec_add(&ttfts, cl->first - cl->t0);
        for (size_t i = 0; i + 1 < cl->gaps.len; i++) dvec_add(&gaps_all, cl->gaps.p[i]); /* not [DONE]'s */
    }
    if (!cl->conn[DECODE]->closing) c_start(cl);
}

/* De-chunked body bytes of the stream leg: count events ("data:" lines), keep the tail. */
static void c_body(client *cl, int leg, const char *d, size_t n) {
    if (leg == PREFILL) {
        buf_add(&cl->prefill, d, n);
        return;
    }
    char edge[8];
    int k = cl->tail_len < 4 ? cl->tail_len : 4, m = n < 4 ? (int)n : 4, found = 0;
    memcpy(edge, cl->tail + cl->tail_len - k, (size_t)k);
    memcpy(edge + k, d, (size_t)m);
    for (int i = 0; i < k; i++)
        if (i + 5 <= k + m && memcmp(edge + i, "data:", 5) == 0) found++; /* across two reads */
    for (const char *p = d; (p = memmem(p, n - (size_t)(p - d), "data:", 5)); p += 5) found++;
    if (found) {
        double now = cl->now;
        if (cl->first) dvec_add(&cl->gaps, now - cl->last);
        else cl->first = now;
        for (int i = 1; i < found; i++) dvec_add(&cl->gaps, 0.0);
        cl->last = now;
        cl->events += found;
        events_total += found;
    }
    if (n >= 8) {
        memcpy(cl->tail, d + n - 8, 8), cl->tail_len = 8;
    } else {
        int keep = 8 - (int)n < cl->tail_len ? 8 - (int)n : cl->tail_len;
        memmove(cl->tail, cl->tail + cl->tail_len - keep, (size_t)keep);
        memcpy(cl->tail + keep, d, n), cl->tail_len = keep + (int)n;
    }
}

static void c_complete(client *cl, int leg) {
    if (leg == PREFILL) c_decode_leg(cl);
    else c_stream_done(cl);
}

/* One step of parsing what is buffered on c; 0 when it needs more bytes. */
static int c_parse_step(cconn *c) {
    client *cl = c->cl;
    buf_t *in = &c->in;
    if (c->state == HEAD) {
        char *end = memmem(in->p, in->len, "\r\n\r\n", 4);
        if (!end) return 0;
        size_t hlen = (size_t)(end - in->p) + 4;
        cl->status = in->len > 12 ? atoi(in->p + 9) : 0;
        long clen = header_value(in->p, hlen, "content-length:");
        int chunked = memmem(in->p, hlen, "chunked", 7) != NULL;
        c->closing = memmem(in->p, hlen, "onnection: close", 16) != NULL; /* then wait for the close */
        buf_drop(in, hlen);
        if (chunked) c->state = CHUNK_SIZE;
        else c->state = BODY_CL, c->remaining = clen < 0 ? 0 : clen;
        if (c->state == BODY_CL && c->remaining == 0) c_complete(cl, c->leg);
        return 1;
    }
    if (c->state == CHUNK_SIZE) {
        char *end = memmem(in->p, in->len, "\r\n", 2);
        if (!end) return 0;
        c->remaining = strtol(in->p, NULL, 16);
        buf_drop(in, (size_t)(end - in->p) + 2);
        c->state = c->remaining ? CHUNK_DATA : TRAILER;
        return 1;
    }
    if (c->state == CHUNK_DATA || c->state == BODY_CL) {
        size_t n = in->len < (size_t)c->remaining ? in->len : (size_t)c->remaining;
        c_body(cl, c->leg, in->p, n);
        buf_drop(in, n);
        c->remaining -= (long)n;
        if (c->remaining == 0) {
            if (c->state == CHUNK_DATA) c->state = CHUNK_CRLF;
            else c->state = HEAD, c_complete(cl, c->leg);
        }
        return 1;
    }
    if (c->state == CHUNK_CRLF) {
        if (in->len < 2) return 0;
        buf_drop(in, 2);
        c->state = CHUNK_SIZE;
        return 1;
    }
    if (in->len < 2) return 0; /* TRAILER: an empty line ends the message */
    if (in->p[0] == '\r' && in->p[1] == '\n') {
        buf_drop(in, 2);
    } else {
        char *end = memmem(in->p, in->len, "\r\n\r\n", 4);
        if (!end) return 0;
        buf_drop(in, (size_t)(end - in->p) + 4);
    }
    c->state = HEAD;
    c_complete(cl, c->leg);
    return 1;
}

static void c_drop(cconn *c) {
    if (c->fd < 0) return;
    ep_set(c->fd, 0, EPOLL_CTL_DEL);
    close(c->fd);
    cconns[c->fd] = NULL;
    c->fd = -1, c->connected = 0;
}

static void c_finish(client *cl) {
    if (cl->closed || cl->active) return;
    cl->closed = 1;
    for (int leg = 0; leg < 1 + two_legs; leg++)
        if (cl->conn[leg]) c_drop(cl->conn[leg]);
    open_clients--;
}

/* A connection closed: a client whose run is not over connects again after BACKOFF (a client
   refused with "connection: close", as a 503 is, comes back as a real one would). */
static void c_lost(cconn *c, const char *why) {
    client *cl = c->cl;
    if (cl->active) error_at(cl, "connection %s mid-stream", why);
    cl->active = 0;
    for (int leg = 0; leg < 1 + two_legs; leg++)
        if (cl->conn[leg]) c_drop(cl->conn[leg]);
    double now = now_s();
    if (!cl->closed && now + BACKOFF < stop_at) {
        rq[(rq_head + rq_len) % (size_t)nclients] = cl->index;
        rq_at[(rq_head + rq_len++) % (size_t)nclients] = now + BACKOFF;
        return;
    }
    c_finish(cl);
}

static void c_read(cconn *c) {
    char b[65536];
    client *cl = c->cl;
    for (;;) {
        ssize_t n = recv(c->fd, b, sizeof b, 0);
        if (n > 0) {
            cl->now = now_s();
            buf_add(&c->in, b, (size_t)n);
            while (c->fd >= 0 && c->in.len && c_parse_step(c)) {}
            if (c->fd < 0 || (size_t)n < sizeof b) return;
            continue;
        }
        if (n < 0 && errno == EAGAIN) return;
        c_lost(c, n == 0 ? "closed" : strerror(errno));
        return;
    }
}

static void c_connect(client *cl, int leg, int port) {
    if (cl->conn[leg]) {
        free(cl->conn[leg]->in.p);
        free(cl->conn[leg]->out.p);
        free(cl->conn[leg]);
    }
    cconn *c = calloc(1, sizeof(cconn));
    c->cl = cl, c->leg = leg, c->fd = -1;
    cl->conn[leg] = c;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0 || fd >= MAXFD) {
        error_at(cl, "socket: %s", strerror(errno));
        if (fd >= 0) close(fd);
        c_finish(cl);
        return;
    }
    c->fd = fd;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cconns[fd] = c;
    ep_set(fd, EPOLLOUT, EPOLL_CTL_ADD);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0 && errno != EINPROGRESS) {
        error_at(cl, "connect: %s", strerror(errno));
        c_drop(c);
        c_finish(cl);
    }
}

static void c_writable(cconn *c) {
    client *cl = c->cl;
    if (c->connected) {
        if (flush_out(c->fd, &c->out) < 0) c_lost(c, "reset");
        return;
    }
    int err = 0;
    socklen_t l = sizeof err;
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l);
    if (err) {
        error_at(cl, "connect: %s", strerror(err));
        c_drop(c);
        c_finish(cl);
        return;
    }
    c->connected = 1;
    ep_set(c->fd, EPOLLIN, EPOLL_CTL_MOD);
    if (cl->conn[DECODE]->connected && (!two_legs || (cl->conn[PREFILL] && cl->conn[PREFILL]->connected)))
        c_start(cl);
}

static void write_doubles(const char *prefix, const char *ext, dvec *v) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, ext);
    FILE *f = fopen(path, "wb");
    if (!f) die(path);
    if (v->len) fwrite(v->p, sizeof(double), v->len, f);
    fclose(f);
}

static void report(const char *prefix, double wall, long unfinished) {
    write_doubles(prefix, "ttft", &ttfts);
    write_doubles(prefix, "gaps", &gaps_all);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
                 (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    printf("{\"streams\":%ld,\"errors\":%ld,\"unfinished\":%ld,\"client_cpu\":%.6f,\"client_wall\":%.6f,"
           "\"events_total\":%ld,\"reconnects\":%ld,\"statuses\":{", streams_ok, errors, unfinished, cpu,
           wall, events_total, reconnects);
    const char *sep = "";
    for (int s = 0; s < 600; s++)
        if (statuses[s]) printf("%s\"%d\":%d", sep, s, statuses[s]), sep = ",";
    printf("},\"first_errors\":[");
    for (long i = 0; i < errors && i < MAX_ERRORS; i++) {
        for (char *p = first_errors[i]; *p; p++)
            if (*p == '"' || *p == '\\' || (unsigned char)*p < 32) *p = ' ';
        printf("%s\"%s\"", i ? "," : "", first_errors[i]);
    }
    printf("]}\n");
}

static int client_main(int argc, char **argv) {
    int port = atoi(arg(argc, argv, "--port", NULL));
    int pport = atoi(arg(argc, argv, "--prefill-port", "0"));
    nclients = atoi(arg(argc, argv, "--clients", "2000"));
    nevents = atoi(arg(argc, argv, "--events", "64"));
    double seconds = atof(arg(argc, argv, "--seconds", "10")), ramp = atof(arg(argc, argv, "--ramp", "2"));
    double drain = atof(arg(argc, argv, "--drain", "15"));
    const char *prefix = arg(argc, argv, "--out", NULL);
    size_t len;
    body_tpl = read_file(arg(argc, argv, "--body", NULL), &len);
    two_legs = pport > 0;
    if (two_legs) prefill_body = read_file(arg(argc, argv, "--prefill-body", NULL), &prefill_len);
    clients = calloc((size_t)nclients, sizeof(client));
    rq = calloc((size_t)nclients, sizeof(int));
    rq_at = calloc((size_t)nclients, sizeof(double));
    epfd = epoll_create1(0);
    started = now_s(), measure_from = started + ramp, stop_at = measure_from + seconds;
    double give_up = stop_at + drain;
    int next = 0;
    open_clients = nclients;
    struct epoll_event evs[1024];
    while (open_clients > 0 && now_s() < give_up) {
        double now = now_s();
        while (next < nclients && started + ramp * next / nclients <= now) {
            client *cl = &clients[next];
            cl->index = next++;
            c_connect(cl, DECODE, port);
            if (two_legs && !cl->closed) c_connect(cl, PREFILL, pport);
        }
        while (rq_len && rq_at[rq_head] <= now) {
            client *cl = &clients[rq[rq_head]];
            rq_head = (rq_head + 1) % (size_t)nclients, rq_len--;
            reconnects++;
            c_connect(cl, DECODE, port);
            if (two_legs && !cl->closed) c_connect(cl, PREFILL, pport);
        }
        int n = epoll_wait(epfd, evs, 1024, next < nclients || rq_len ? 1 : 100);
        for (int i = 0; i < n; i++) {
            cconn *c = cconns[evs[i].data.fd];
            if (c && (evs[i].events & EPOLLOUT)) c_writable(c);
            c = cconns[evs[i].data.fd];
            if (c && c->connected && (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) c_read(c);
        }
    }
    long unfinished = 0;
    for (int i = 0; i < nclients; i++)
        if (clients[i].active) {
            unfinished++;
            error_at(&clients[i], "unfinished when the drain bound passed");
        }
    report(prefix, now_s() - started, unfinished);
    return 0;
}

int main(int argc, char **argv) {
    raise_nofile();
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc > 1 && strcmp(argv[1], "server") == 0) return server_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "client") == 0) return client_main(argc, argv);
    fprintf(stderr, "usage: streams server|client [options]\n");
    return 2;
}
