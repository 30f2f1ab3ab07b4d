/* Calls hbmalloc's C ABI through include/hbmalloc.h, compiled and linked
 * against the built cdylib by tests/c_abi.rs: proves the header matches the
 * library (names, argument and return types, status values).
 * Run with HBMALLOC_CUDA_DRIVER pointing at the driver test double and
 * HBMALLOC_CONF=policy:pytorch (host-backed segments). */
#include "hbmalloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

int main(int argc, char **argv) {
    cudaStream_t stream = (cudaStream_t)0;
    const char *snapshot_path = argc > 1 ? argv[1] : "abi_test.pickle";

    CHECK(hbmalloc_init(1) == HBMALLOC_OK);

    /* Round trip with bytes written through the pointer. */
    unsigned char *p = hbmalloc_alloc(4096, 0, stream);
    CHECK(p != NULL);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);
    memset(p, 0x5a, 4096);
    CHECK(p[4095] == 0x5a);
    CHECK(hbmalloc_record_stream(p, 0, stream) == HBMALLOC_OK);

    /* Errors and their codes. */
    CHECK(hbmalloc_alloc(-5, 0, stream) == NULL);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_INVALID_ARGUMENT);
    CHECK(hbmalloc_alloc(64, 7, stream) == NULL);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_DEVICE_OUT_OF_RANGE);
    CHECK(hbmalloc_alloc((ssize_t)1 << 40, 0, stream) == NULL);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OUT_OF_MEMORY);
    hbmalloc_free((void *)0x1000, 0, 0, stream);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_UNKNOWN_POINTER);
    char message[256];
    ssize_t length = hbmalloc_last_error(message, sizeof message);
    CHECK(length > 0 && strstr(message, "0x1000") != NULL);
    CHECK(hbmalloc_set_memory_fraction(-1.0, 0) == HBMALLOC_INVALID_ARGUMENT);
    CHECK(hbmalloc_set_memory_fraction(0.5, 0) == HBMALLOC_OK);
    hbmalloc_free(NULL, 0, 0, stream);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);
    CHECK(hbmalloc_last_error(message, sizeof message) == 0 && message[0] == '\0');

    /* Stats and summary, sized snprintf style. */
    ssize_t json_length = hbmalloc_stats_json(0, NULL, 0);
    CHECK(json_length > 0);
    char *json = malloc((size_t)json_length + 1);
    CHECK(hbmalloc_stats_json(0, json, (size_t)json_length + 1) == json_length);
    CHECK(json[0] == '{' && json[json_length - 1] == '}');
    CHECK(strstr(json, "\"allocation.all.current\": 1") != NULL);
    free(json);
    const char *keys[] = {"allocation.all.current", "allocated_bytes.all.current"};
    int64_t values[2] = {-1, -1};
    CHECK(hbmalloc_stats_values(0, keys, 2, values) == HBMALLOC_OK);
    CHECK(values[0] == 1 && values[1] >= 4096);
    double fraction = 0.0;
    CHECK(hbmalloc_memory_fraction(0, &fraction) == HBMALLOC_OK && fraction == 0.5);
    size_t largest_block = 0;
    CHECK(hbmalloc_cache_info(0, &largest_block) == HBMALLOC_OK && largest_block > 0);
    size_t free_bytes = 0, total_bytes = 0;
    CHECK(hbmalloc_mem_get_info(0, &free_bytes, &total_bytes) == HBMALLOC_OK);
    CHECK(free_bytes > 0 && free_bytes < total_bytes);
    char summary[8192];
    CHECK(hbmalloc_summary(0, 1, summary, sizeof summary) > 0);
    CHECK(strstr(summary, "PyTorch CUDA memory summary, device ID 0") != NULL);

    CHECK(hbmalloc_snapshot(0, snapshot_path) == HBMALLOC_OK);
    CHECK(hbmalloc_reset_peak_stats(0) == HBMALLOC_OK);
    CHECK(hbmalloc_reset_accumulated_stats(0) == HBMALLOC_OK);
    json_length = hbmalloc_stats_json(0, NULL, 0);
    json = malloc((size_t)json_length + 1);
    CHECK(hbmalloc_stats_json(0, json, (size_t)json_length + 1) == json_length);
    CHECK(strstr(json, "\"allocation.all.allocated\": 0") != NULL);
    free(json);
    CHECK(hbmalloc_set_history_entries(-1, 0) == HBMALLOC_INVALID_ARGUMENT);
    CHECK(hbmalloc_set_history_entries(1000, 1) == HBMALLOC_OK);

    hbmalloc_free(p, 4096, 0, stream);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);
    hbmalloc_free(p, 4096, 0, stream);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_UNKNOWN_POINTER);
    CHECK(hbmalloc_empty_cache(0) == HBMALLOC_OK);

    /* A private pool during a capture: its own memory, no empty_cache. */
    int holders = -1;
    CHECK(hbmalloc_pool_alloc(64, 0, stream, 5, 0) == NULL);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_INVALID_ARGUMENT);
    CHECK(hbmalloc_create_or_incref_pool(0, 5, 0) == HBMALLOC_OK);
    CHECK(hbmalloc_begin_capture(0) == HBMALLOC_OK);
    unsigned char *g = hbmalloc_pool_alloc(4096, 0, stream, 5, 0);
    CHECK(g != NULL);
    memset(g, 0x33, 4096);
    CHECK(hbmalloc_empty_cache(0) == HBMALLOC_INVALID_STATE);
    CHECK(hbmalloc_end_capture(0) == HBMALLOC_OK);
    CHECK(hbmalloc_end_capture(0) == HBMALLOC_INVALID_STATE);
    CHECK(hbmalloc_pool_use_count(0, 5, 0, &holders) == HBMALLOC_OK && holders == 1);
    CHECK(hbmalloc_release_pool(0, 5, 0) == HBMALLOC_OK);
    CHECK(hbmalloc_pool_use_count(0, 5, 0, &holders) == HBMALLOC_OK && holders == 0);
    hbmalloc_free(g, 4096, 0, stream);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);
    CHECK(hbmalloc_release_pool(0, 5, 0) == HBMALLOC_INVALID_ARGUMENT);

    CHECK(hbmalloc_reset() == HBMALLOC_OK);
    CHECK(hbmalloc_last_error_code() == HBMALLOC_OK);

    printf("abi_test: %d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
