"""cffi (API mode) build script for ``fabric._libfabric``.

The extension binds the system libfabric (Debian: ``libfabric1`` +
``libfabric-dev``, 1.17) and compiles our native helper ``csrc/pdf_core.c``
into it, so that batches of writes are posted and completions polled in C;
``csrc/pdf_wait.c`` is how its progress thread sleeps and wakes.

setup.py uses it through ``cffi_modules=["fabric/_ffi_build.py:ffibuilder"]``;
during development build it in place with::

    python fabric/_ffi_build.py
"""

from __future__ import annotations

import os
import tempfile

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))

PDF_CDEF = """
typedef struct pdf_engine pdf_engine;

typedef struct pdf_event {
    uint32_t kind;
    int32_t code;
    uint64_t id;
    uint64_t count;
    uint64_t aux;
} pdf_event;

typedef struct pdf_info {
    char provider[64];
    char fabric[128];
    char domain[128];
    uint64_t mr_mode;
    uint64_t tx_size;
    uint64_t rx_size;
    uint64_t tx_credits;
    uint64_t max_msg_size;
    uint64_t inject_size;
    uint64_t cq_data_size;
    uint32_t wait_mode;
    uint32_t delivery_complete;
    uint32_t addrlen;
    uint8_t addr[256];
} pdf_info;

#define PDF_EV_BATCH_DONE 1
#define PDF_EV_BATCH_FAILED 2
#define PDF_EV_IMM 3
#define PDF_EV_RECV 4
#define PDF_EV_SEND_DONE 5
#define PDF_EV_SEND_FAILED 6
#define PDF_EV_PEER_FAILED 7
#define PDF_EV_CQ_ERROR 8

#define PDF_IMM_NONE 0
#define PDF_IMM_LAST 1
#define PDF_IMM_EVERY 2

#define PDF_IMM_TAG_MAX ...
#define PDF_IMM_UNIT_MAX ...

#define PDF_BAD_SHORT 1
#define PDF_BAD_LONG 2
#define PDF_BAD_SRC 3
#define PDF_BAD_DST 4

typedef struct pdf_sync_result {
    int64_t writes;
    uint32_t status;
    int32_t code;
    uint64_t missing;
    uint64_t spin_ns;
    uint32_t rounds;
    uint32_t slept;
} pdf_sync_result;

#define PDF_SYNC_DONE 1
#define PDF_SYNC_FAILED 2
#define PDF_SYNC_TIMEOUT 3

#define PDF_WAIT_SLEEP 0
#define PDF_WAIT_FD 1
#define PDF_WAIT_BELL 2

#define FI_MR_LOCAL ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_ECANCELED ...
#define FI_ETIMEDOUT ...
#define FI_EINVAL ...
#define FI_EBUSY ...
#define FI_ESHUTDOWN ...
#define FI_EHOSTUNREACH ...
#define FI_ECONNREFUSED ...
#define FI_EMSGSIZE ...
#define FI_ENOENT ...
#define FI_EACCES ...
#define FI_EAGAIN ...
#define FI_ENOSYS ...
#define FI_ECONNRESET ...

const char *fi_strerror(int errnum);
uint32_t fi_version(void);

const char *pdf_strerror(int code);
int pdf_open(const char *prov, const char *node, uint32_t tx_cap, uint32_t nrecv,
             uint32_t msg_size, uint32_t spin_us, uint32_t busy_spin_us, uint32_t sleep_max_us,
             uint32_t peer_timeout_ms, int delivery_complete, int busy_poll, const char *bell_name,
             pdf_engine **out, char *err, size_t errlen);
int pdf_get_info(pdf_engine *e, pdf_info *out);
int pdf_mr_reg(pdf_engine *e, uint64_t addr, uint64_t len, uint64_t *key_out,
               uint64_t *desc_out, uint64_t *mr_out);
int pdf_mr_close(pdf_engine *e, uint64_t mr);
int pdf_av_insert(pdf_engine *e, const uint8_t *addr, uint64_t *fi_addr_out);
int pdf_av_remove(pdf_engine *e, uint64_t fi_addr);
int64_t pdf_submit_writes(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base,
                          uint64_t desc, uint64_t remote_base, uint64_t rkey,
                          const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                          uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                          int coalesce);
int pdf_write_sync(pdf_engine *e, uint64_t id, uint64_t peer, uint64_t local_base, uint64_t desc,
                   uint64_t remote_base, uint64_t rkey, const uint64_t *src, const uint64_t *dst,
                   const uint64_t *len, uint32_t n, uint32_t imm, int imm_mode, uint64_t max_write,
                   int coalesce, uint32_t spin_us, int64_t timeout_us, pdf_sync_result *res);
int64_t pdf_check_writes(const uint64_t *src, const uint64_t *dst, const uint64_t *len, uint32_t n,
                         uint64_t src_size, uint64_t dst_size, uint64_t max_len, int *what, uint64_t *total);
int pdf_submit_send(pdf_engine *e, uint64_t id, uint64_t peer, const uint8_t *data, uint32_t len);
const uint8_t *pdf_recv_buf(pdf_engine *e, uint32_t slot);
void pdf_recv_release(pdf_engine *e, uint32_t slot);
int pdf_fail_peer(pdf_engine *e, uint64_t peer, int code, pdf_event *ev, int cap);
int pdf_fail_all(pdf_engine *e, int code, pdf_event *ev, int cap);
uint64_t pdf_outstanding(pdf_engine *e);
void pdf_stop(pdf_engine *e);
void pdf_poke(pdf_engine *e);
int pdf_peer_local(pdf_engine *e, uint64_t peer, int pid, const char *bell_name);
uint64_t pdf_locks_released(pdf_engine *e);
int pdf_progress(pdf_engine *e, pdf_event *ev, int cap, int64_t timeout_us);
void pdf_close_ep(pdf_engine *e);
void pdf_close(pdf_engine *e);
"""


def _source() -> str:
    with open(os.path.join(_HERE, "csrc", "pdf_core.c"), encoding="utf-8") as f:
        return f.read()


_C_FILES = ("pdf_wait.c", "pdf_shm.c")


def make_builder(absolute_sources: bool) -> FFI:
    """The FFI builder. setuptools wants the extra C files relative to its working directory
    (the repository root; it refuses absolute paths); cffi's own compile() runs in a temporary
    directory and needs them absolute."""
    paths = [os.path.join(_HERE, "csrc", name) for name in _C_FILES]
    builder = FFI()
    builder.cdef(PDF_CDEF)
    builder.set_source(
        "fabric._libfabric",
        _source(),
        sources=paths if absolute_sources else [os.path.relpath(p) for p in paths],
        include_dirs=[os.path.join(_HERE, "csrc")],
        libraries=["fabric"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    )
    return builder


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (fabric/_libfabric*.so).
    with tempfile.TemporaryDirectory(prefix="pdserve-fabric-build-") as tmp:
        so_path = make_builder(absolute_sources=True).compile(tmpdir=tmp, verbose=False)
        target = os.path.join(_HERE, os.path.basename(so_path))
        os.replace(so_path, target)
        print(target)
