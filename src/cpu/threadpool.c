/*
 * A small persistent thread pool for the CPU backend.
 *
 * kda_pool_run(pool, n, fn, arg) runs fn(arg, item, thread) for item in [0, n) on the pool's threads and the
 * calling thread (thread 0), handing items out one at a time through an atomic counter (work items are
 * (sequence, head) pairs of very different lengths, so dynamic scheduling balances them). It returns when
 * every item is done. Threads are started once, in kda_create / kda_set_num_threads, never inside a call.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "threadpool.h"

struct kda_threadpool {
    int num_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_mutex_t run_lock; /* one kda_pool_run at a time */
    /* the job being run */
    uint64_t generation;
    int stop;
    kda_pool_fn fn;
    void *arg;
    int64_t num_items;
    atomic_int_fast64_t next;
    int busy; /* workers still inside the current generation */
};

typedef struct {
    kda_threadpool_t *pool;
    int id;
} worker_arg_t;

static void work(kda_threadpool_t *pool, int id) {
    for (;;) {
        int64_t item = atomic_fetch_add(&pool->next, 1);
        if (item >= pool->num_items) break;
        pool->fn(pool->arg, item, id);
    }
}

static void *worker_main(void *p) {
    worker_arg_t wa = *(worker_arg_t *)p;
    free(p);
    kda_threadpool_t *pool = wa.pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stop && pool->generation == seen) pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->stop) break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->lock);
        work(pool, wa.id);
        pthread_mutex_lock(&pool->lock);
        if (--pool->busy == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

kda_threadpool_t *kda_pool_create(int num_threads) {
    if (num_threads < 1) num_threads = 1;
    kda_threadpool_t *pool = (kda_threadpool_t *)calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->num_threads = num_threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->next, 0);
    if (num_threads > 1) {
        pool->threads = (pthread_t *)calloc((size_t)num_threads - 1, sizeof(pthread_t));
        if (!pool->threads) {
            kda_pool_destroy(pool);
            return NULL;
        }
        for (int i = 1; i < num_threads; i++) {
            worker_arg_t *wa = (worker_arg_t *)malloc(sizeof *wa);
            if (wa) {
                wa->pool = pool;
                wa->id = i;
            }
            if (!wa || pthread_create(&pool->threads[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                pool->num_threads = i; /* only i - 1 workers exist: stop those */
                kda_pool_destroy(pool);
                return NULL;
            }
        }
    }
    return pool;
}

void kda_pool_destroy(kda_threadpool_t *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->num_threads && pool->threads; i++) pthread_join(pool->threads[i - 1], NULL);
    free(pool->threads);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->run_lock);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool);
}

int kda_pool_size(const kda_threadpool_t *pool) { return pool ? pool->num_threads : 1; }

void kda_pool_run(kda_threadpool_t *pool, int64_t num_items, kda_pool_fn fn, void *arg) {
    if (num_items <= 0) return;
    if (!pool || pool->num_threads == 1 || num_items == 1) {
        for (int64_t i = 0; i < num_items; i++) fn(arg, i, 0);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->num_items = num_items;
    atomic_store(&pool->next, 0);
    pool->busy = pool->num_threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);

    work(pool, 0);

    pthread_mutex_lock(&pool->lock);
    while (pool->busy > 0) pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->run_lock);
}
