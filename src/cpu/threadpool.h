/* A persistent thread pool: see threadpool.c. */
#ifndef KDA_CPU_THREADPOOL_H
#define KDA_CPU_THREADPOOL_H

#include <stdint.h>

typedef struct kda_threadpool kda_threadpool_t;

/* fn(arg, item, thread): thread is in [0, kda_pool_size(pool)), 0 being the caller of kda_pool_run. */
typedef void (*kda_pool_fn)(void *arg, int64_t item, int thread);

kda_threadpool_t *kda_pool_create(int num_threads);
void kda_pool_destroy(kda_threadpool_t *pool);
int kda_pool_size(const kda_threadpool_t *pool);
void kda_pool_run(kda_threadpool_t *pool, int64_t num_items, kda_pool_fn fn, void *arg);

#endif /* KDA_CPU_THREADPOOL_H */
