/* CHECK(cond) for the test programs that tests/c_abi.rs compiles (C and
 * C++): counts checks, and on a failure prints the condition with
 * hbmalloc's last error and counts it. The program ends with
 * printf("..., %d failed\n", failures), which c_abi.rs looks for. */
#ifndef HBMALLOC_TEST_CHECK_H
#define HBMALLOC_TEST_CHECK_H

#include <stdio.h>

#include "hbmalloc.h"

static int failures = 0;
static int checks = 0;

#define CHECK(cond)                                                          \
    do {                                                                     \
        checks++;                                                            \
        if (!(cond)) {                                                       \
            char message_[512];                                              \
            hbmalloc_last_error(message_, sizeof message_);                  \
            fprintf(stderr, "%s:%d: check failed: %s (last error %d: %s)\n", \
                    __FILE__, __LINE__, #cond, hbmalloc_last_error_code(),   \
                    message_);                                               \
            failures++;                                                      \
        }                                                                    \
    } while (0)

#endif
