/*
 * fi_bench.c - reference for bench.fabric.transfer (bench/fabric/transfer.py): windowed fi_writedata
 * between two processes, written directly against libfabric.
 *
 * The process forks: the child receives (registers a pool, busy-polls its CQ
 * counting immediate data), the parent sends (keeps `window` writes in
 * flight, every write carries immediate data, as imm_mode="every").
 * Addresses and keys travel over pipes.  Prints one JSON line per run:
 *   {"provider":..., "size":..., "writes":..., "seconds":..., "gbps":..., "lat_us":...}
 * Bandwidth: time from the first post to the last local completion.
 * Latency: one write at a time, post to local completion, averaged.
 *
 * Build: cc -O2 -o fi_bench fi_bench.c -lfabric
 * Usage: fi_bench PROVIDER NODE SIZE TOTAL_BYTES WINDOW LAT_ITERS HUGE(0|1)
 *        fi_bench copy SIZE TOTAL_BYTES HUGE(0|1)
 * The second form measures the copy ceilings of the same pools, no libfabric:
 *   memcpy_gbps  memcpy of SIZE blocks between two pools of this process;
 *   cma_gbps     process_vm_readv of SIZE blocks from the parent's pool into
 *                the child's, which is how shm moves an RMA write above its
 *                inject size (the target copies from the initiator with CMA).
 * HUGE=1 puts both pools on transparent huge pages (2 MiB aligned,
 * MADV_HUGEPAGE); src_huge_kib / dst_huge_kib report how much of each pool
 * the kernel actually backs with huge pages.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int _r = (int)(call);                                                            \
        if (_r) {                                                                        \
            fprintf(stderr, "%s:%d %s = %d (%s)\n", __FILE__, __LINE__, #call, _r,        \
                    fi_strerror(_r < 0 ? -_r : _r));                                      \
            exit(2);                                                                     \
        }                                                                                \
    } while (0)

#define POOL_BYTES (64ull << 20)

struct ctx {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_mr *mr;
    char *pool;
    void *desc;
};

struct remote {
    uint8_t addr[256];
    size_t addrlen;
    uint64_t base;
    uint64_t key;
    long huge_kib; /* of the receiver's pool */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void xwrite(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t r = write(fd, p, len);
        if (r <= 0) {
            perror("write");
            exit(2);
        }
        p += r;
        len -= (size_t)r;
    }
}

static void xread(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t r = read(fd, p, len);
        if (r <= 0) {
            perror("read");
            exit(2);
        }
        p += r;
        len -= (size_t)r;
    }
}

#define HUGE_BYTES (2ull << 20)

/* Anonymous memory; with `huge`, a 2 MiB aligned window advised
 * MADV_HUGEPAGE (the same recipe as pdserve.engine.cache.hostmem.alloc_buffer). */
static char *alloc_pool(size_t bytes, int huge)
{
    size_t extra = huge ? HUGE_BYTES : 0;
    char *raw = mmap(NULL, bytes + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    if (!huge)
        return raw;
    uintptr_t base = ((uintptr_t)raw + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1);
    size_t head = base - (uintptr_t)raw;
    if (head)
        munmap(raw, head);
    if (extra - head)
        munmap((char *)base + bytes, extra - head);
    if (madvise((void *)base, bytes, MADV_HUGEPAGE))
        perror("madvise(MADV_HUGEPAGE)");
    return (char *)base;
}

/* KiB of [p, p + bytes) backed by transparent huge pages (from smaps). */
static long huge_kib(const void *p, size_t bytes)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        return -1;
    char line[512];
    int inside = 0;
    long total = 0;
    uintptr_t start = (uintptr_t)p, end = start + bytes;
    while (fgets(line, sizeof(line), f)) {
        unsigned long lo, hi, kib;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            inside = lo < end && hi > start;
        else if (inside && sscanf(line, "AnonHugePages: %lu kB", &kib) == 1)
            total += (long)kib;
    }
    fclose(f);
    return total;
}

static void open_ctx(struct ctx *c, const char *prov, const char *node, int huge)
{
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->av_type = FI_AV_TABLE;
    hints->fabric_attr->prov_name = strdup(prov);
    int use_node = strcmp(prov, "shm") != 0 && node[0];
    CHECK(fi_getinfo(FI_VERSION(1, 17), use_node ? node : NULL, NULL, use_node ? FI_SOURCE : 0, hints, &c->info));
    fi_freeinfo(hints);
    CHECK(fi_fabric(c->info->fabric_attr, &c->fabric, NULL));
    CHECK(fi_domain(c->fabric, c->info, &c->domain, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE, .count = 4};
    CHECK(fi_av_open(c->domain, &av_attr, &c->av, NULL));
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE,
                                 .size = c->info->tx_attr->size + c->info->rx_attr->size};
    CHECK(fi_cq_open(c->domain, &cq_attr, &c->cq, NULL));
    CHECK(fi_endpoint(c->domain, c->info, &c->ep, NULL));
    CHECK(fi_ep_bind(c->ep, &c->av->fid, 0));
    CHECK(fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_enable(c->ep));
    c->pool = alloc_pool(POOL_BYTES, huge);
    memset(c->pool, 0x5a, POOL_BYTES);
    CHECK(fi_mr_reg(c->domain, c->pool, POOL_BYTES, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, 0, 1, 0,
                    &c->mr, NULL));
    c->desc = fi_mr_desc(c->mr);
}

static void close_ctx(struct ctx *c)
{
    fi_close(&c->ep->fid);
    fi_close(&c->mr->fid);
    fi_close(&c->cq->fid);
    fi_close(&c->av->fid);
    fi_close(&c->domain->fid);
    fi_close(&c->fabric->fid);
    fi_freeinfo(c->info);
    munmap(c->pool, POOL_BYTES);
}

/* Poll the CQ; returns completions seen (remote data or local). */
static long poll_cq(struct ctx *c, long *imm)
{
    struct fi_cq_data_entry ent[64];
    ssize_t r = fi_cq_read(c->cq, ent, 64);
    if (r == -FI_EAGAIN)
        return 0;
    if (r == -FI_EAVAIL) {
        struct fi_cq_err_entry err = {0};
        fi_cq_readerr(c->cq, &err, 0);
        fprintf(stderr, "cq error: %s\n", fi_strerror(err.err));
        exit(3);
    }
    if (r < 0) {
        fprintf(stderr, "fi_cq_read: %s\n", fi_strerror((int)-r));
        exit(3);
    }
    long local = 0;
    for (ssize_t i = 0; i < r; i++) {
        if (ent[i].flags & FI_REMOTE_CQ_DATA)
            (*imm)++;
        else
            local++;
    }
    return local;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Bytes per second of copying `total` bytes in `size` blocks, cycling over
 * the pools (64 MiB, larger than the last-level cache). */
static double copy_rate(char *dst, const char *src, uint64_t size, uint64_t total, pid_t from)
{
    uint64_t slots = POOL_BYTES / size, n = total / size;
    double t0 = now_s();
    for (uint64_t i = 0; i < n; i++) {
        uint64_t off = (i % slots) * size;
        if (from) {
            struct iovec local = {dst + off, size}, remote = {(void *)(src + off), size};
            if (process_vm_readv(from, &local, 1, &remote, 1, 0) != (ssize_t)size) {
                perror("process_vm_readv");
                exit(2);
            }
        } else {
            memcpy(dst + off, src + off, size);
        }
    }
    return (double)n * (double)size / (now_s() - t0);
}

static int copy_main(uint64_t size, uint64_t total, int huge)
{
    if (size == 0 || size > POOL_BYTES || total < size) {
        fprintf(stderr, "bad size %llu / total %llu\n", (unsigned long long)size, (unsigned long long)total);
        return 1;
    }
    int c2p[2], p2c[2];
    if (pipe(c2p) || pipe(p2c)) {
        perror("pipe");
        return 2;
    }
    pid_t parent = getpid();
    /* fork before allocating: pools shared copy-on-write lose their huge pages */
    pid_t pid = fork();
    if (pid == 0) { /* reads the parent's pool into its own, as an shm target does */
        char *mine = alloc_pool(POOL_BYTES, huge);
        memset(mine, 0, POOL_BYTES);
        char *src;
        xread(p2c[0], &src, sizeof(src));
        copy_rate(mine, src, size, POOL_BYTES, parent); /* warm-up */
        double cma = copy_rate(mine, src, size, total, parent);
        long kib = huge_kib(mine, POOL_BYTES);
        xwrite(c2p[1], &cma, sizeof(cma));
        xwrite(c2p[1], &kib, sizeof(kib));
        _exit(0);
    }
    char *src = alloc_pool(POOL_BYTES, huge), *dst = alloc_pool(POOL_BYTES, huge);
    memset(src, 0x5a, POOL_BYTES);
    memset(dst, 0, POOL_BYTES);
    copy_rate(dst, src, size, POOL_BYTES, 0); /* warm-up */
    double mem = copy_rate(dst, src, size, total, 0);
    xwrite(p2c[1], &src, sizeof(src));
    double cma;
    long child_kib;
    xread(c2p[0], &cma, sizeof(cma));
    xread(c2p[0], &child_kib, sizeof(child_kib));
    waitpid(pid, NULL, 0);
    printf("{\"size\": %llu, \"huge\": %d, \"memcpy_gbps\": %.4f, \"cma_gbps\": %.4f, \"src_huge_kib\": %ld, "
           "\"dst_huge_kib\": %ld}\n",
           (unsigned long long)size, huge, mem / 1e9, cma / 1e9, huge_kib(src, POOL_BYTES), child_kib);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "copy") == 0)
        return copy_main(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), atoi(argv[4]));
    if (argc != 8) {
        fprintf(stderr, "usage: %s PROVIDER NODE SIZE TOTAL_BYTES WINDOW LAT_ITERS HUGE\n", argv[0]);
        return 1;
    }
    const char *prov = argv[1];
    const char *node = argv[2];
    uint64_t size = strtoull(argv[3], NULL, 0);
    uint64_t total = strtoull(argv[4], NULL, 0);
    long window = strtol(argv[5], NULL, 0);
    long lat_iters = strtol(argv[6], NULL, 0);
    int huge = atoi(argv[7]);
    long nwrites = (long)(total / size);
    uint64_t slots = POOL_BYTES / size;
    if (size == 0 || size > POOL_BYTES || nwrites == 0) {
        fprintf(stderr, "bad size %llu / total %llu\n", (unsigned long long)size, (unsigned long long)total);
        return 1;
    }

    int r2s[2], s2r[2];
    if (pipe(r2s) || pipe(s2r)) {
        perror("pipe");
        return 2;
    }
    pid_t pid = fork();
    if (pid == 0) { /* receiver */
        struct ctx c;
        open_ctx(&c, prov, node, huge);
        struct remote me = {.addrlen = sizeof(me.addr)};
        CHECK(fi_getname(&c.ep->fid, me.addr, &me.addrlen));
        me.base = (c.info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)c.pool : 0;
        me.key = fi_mr_key(c.mr);
        me.huge_kib = huge_kib(c.pool, POOL_BYTES);
        xwrite(r2s[1], &me, sizeof(me));
        long expect = nwrites + lat_iters, imm = 0;
        while (imm < expect)
            poll_cq(&c, &imm);
        char done;
        xread(s2r[0], &done, 1); /* keep the endpoint until the sender is done */
        close_ctx(&c);
        _exit(0);
    }
    struct ctx c;
    open_ctx(&c, prov, node, huge);
    struct remote peer;
    xread(r2s[0], &peer, sizeof(peer));
    fi_addr_t dest;
    if (fi_av_insert(c.av, peer.addr, 1, &dest, 0, NULL) != 1) {
        fprintf(stderr, "fi_av_insert failed\n");
        return 2;
    }
    struct fi_context2 *ctxs = calloc((size_t)window, sizeof(*ctxs));
    long posted = 0, done = 0, imm = 0;
    double t0 = now_s();
    while (done < nwrites) {
        while (posted < nwrites && posted - done < window) {
            uint64_t off = (uint64_t)(posted % (long)slots) * size;
            ssize_t r = fi_writedata(c.ep, c.pool + off, size, c.desc, 7, dest, peer.base + off, peer.key,
                                     &ctxs[posted % window]);
            if (r == -FI_EAGAIN)
                break;
            CHECK(r);
            posted++;
        }
        done += poll_cq(&c, &imm);
    }
    double bw_s = now_s() - t0;
    double lat_total = 0;
    double *lats = calloc((size_t)(lat_iters > 0 ? lat_iters : 1), sizeof(double));
    for (long i = 0; i < lat_iters; i++) {
        double t = now_s();
        ssize_t r;
        while ((r = fi_writedata(c.ep, c.pool, size, c.desc, 8, dest, peer.base, peer.key, &ctxs[0])) == -FI_EAGAIN)
            poll_cq(&c, &imm);
        CHECK(r);
        while (poll_cq(&c, &imm) == 0)
            ;
        lats[i] = now_s() - t;
        lat_total += lats[i];
    }
    qsort(lats, (size_t)lat_iters, sizeof(double), cmp_double);
    xwrite(s2r[1], "x", 1);
    int status = 0;
    waitpid(pid, &status, 0);
    printf("{\"provider\": \"%s\", \"size\": %llu, \"writes\": %ld, \"window\": %ld, \"seconds\": %.6f, "
           "\"gbps\": %.4f, \"lat_us\": %.3f, \"lat_p50_us\": %.3f, \"src_huge_kib\": %ld, "
           "\"dst_huge_kib\": %ld, \"receiver_status\": %d}\n",
           prov, (unsigned long long)size, nwrites, window, bw_s, (double)nwrites * (double)size / bw_s / 1e9,
           lat_iters ? lat_total / (double)lat_iters * 1e6 : 0.0, lat_iters ? lats[lat_iters / 2] * 1e6 : 0.0,
           huge_kib(c.pool, POOL_BYTES), peer.huge_kib, status);
    free(lats);
    close_ctx(&c);
    free(ctxs);
    return status ? 4 : 0;
}
