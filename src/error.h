/* The error helper every layer may use (error.c): a thread-local message, set by the failing call. */
#ifndef KDA_ERROR_H
#define KDA_ERROR_H

#include <stdarg.h>

#include "kda.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KDA_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KDA_PRINTF(a, b)
#endif

/* Format the message of a failing call and return `status`. */
kda_status_t kda_error(kda_status_t status, const char *fmt, ...) KDA_PRINTF(2, 3);

#ifdef __cplusplus
}
#endif

#endif /* KDA_ERROR_H */
