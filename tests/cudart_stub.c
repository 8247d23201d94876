/* A stand-in of the CUDA runtime's C library, for tests/test_device.py: the calls feeder.device.cudart
 * makes through ctypes, with the real signatures, doing on the CPU what the real ones do on a GPU
 * (copies are memcpy, made at once; events complete at once). Built by the test with the C compiler
 * (skipped without one) as a library whose soname is libcudart.so.13, so that feeder finds it already
 * loaded (RTLD_NOLOAD), as it finds the one ONNX Runtime's CUDA provider loads. */
#include <stdlib.h>
#include <string.h>

static int last_error = 0;
static int registered = 0;
static int device = -1;
static long copied = 0;

static int fail(int code) { last_error = code; return code; }

int cudaHostAlloc(void **p, size_t n, unsigned flags) { *p = malloc(n ? n : 1); return *p ? 0 : fail(2); }
int cudaFreeHost(void *p) { free(p); return 0; }
int cudaHostRegister(void *p, size_t n, unsigned flags) {
    if (!p || !n || flags != 1) return fail(1);  /* cudaErrorInvalidValue */
    registered++; return 0;
}
int cudaHostUnregister(void *p) { if (registered <= 0) return fail(713); registered--; return 0; }
int cudaStreamCreateWithFlags(void **s, unsigned flags) { *s = malloc(8); return flags == 1 ? 0 : fail(1); }
int cudaStreamDestroy(void *s) { free(s); return 0; }
int cudaStreamSynchronize(void *s) { return s ? 0 : fail(400); }
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *s) {
    if (kind != 1 || !s) return fail(21);  /* cudaErrorInvalidMemcpyDirection */
    memcpy(dst, src, n); copied += (long)n; return 0;
}
int cudaEventCreateWithFlags(void **e, unsigned flags) { *e = malloc(8); return 0; }
int cudaEventDestroy(void *e) { free(e); return 0; }
int cudaEventRecord(void *e, void *s) { return e && s ? 0 : fail(400); }
int cudaEventSynchronize(void *e) { return 0; }
int cudaEventQuery(void *e) { return 0; }
int cudaEventElapsedTime(float *ms, void *a, void *b) { *ms = 0.25f; return 0; }
int cudaSetDevice(int d) { device = d; return 0; }
const char *cudaGetErrorString(int code) { return code == 1 ? "invalid argument" : "some error"; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
/* for the test */
int stub_registered(void) { return registered; }
int stub_device(void) { return device; }
long stub_copied(void) { return copied; }
int stub_last_error(void) { return last_error; }
