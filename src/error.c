/*
 * The error text of the failing call: every layer (the API, the validation, each backend) reports through
 * kda_error, and kda_last_error returns the message of the calling thread's last failure.
 */
#include <stdio.h>

#include "error.h"

static _Thread_local char last_error[512];

const char *kda_last_error(void) { return last_error; }

kda_status_t kda_error(kda_status_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}
