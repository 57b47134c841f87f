/* Removed chunk files kept for reuse: a list per engine, under a mutex.  See pool.h. */
#define _GNU_SOURCE
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "chunkio.h"

#define POOL_MAX_FILES 4096

struct chunk_pool {
    pthread_mutex_t mu;
    char *suffix;
    uint64_t max_bytes, bytes; /* bytes: of the files listed and of those being put */
    size_t count, putting;     /* files listed, and being put */
    pooled_file files[];       /* POOL_MAX_FILES */
};

chunk_pool *chunk_pool_new(const char *suffix, uint64_t max_bytes) {
    chunk_pool *pool = calloc(1, sizeof(chunk_pool) + POOL_MAX_FILES * sizeof(pooled_file));
    if (pool == NULL || (pool->suffix = strdup(suffix)) == NULL) {
        free(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->mu, NULL);
    pool->max_bytes = max_bytes;
    return pool;
}

void pooled_file_clear(pooled_file *f) {
    free(f->dir_rel);
    free(f->name);
    f->dir_rel = f->name = NULL;
}

void chunk_pool_drain(chunk_pool *pool) {
    if (pool == NULL) return;
    pthread_mutex_lock(&pool->mu);
    pool->max_bytes = 0; /* files being put now are removed by their putters */
    size_t count = pool->count;
    pool->count = 0;
    for (size_t i = 0; i < count; i++) pool->bytes -= (uint64_t)pool->files[i].size;
    pthread_mutex_unlock(&pool->mu);
    for (size_t i = 0; i < count; i++) {
        pooled_file *f = &pool->files[i];
        char rel[PATH_MAX];
        if (snprintf(rel, sizeof(rel), "%s/%s", f->dir_rel, f->name) < (int)sizeof(rel))
            chunk_unlink(NULL, f->root_fd, rel);
        pooled_file_clear(f);
    }
}

void chunk_pool_free(chunk_pool *pool) {
    if (pool == NULL) return;
    chunk_pool_drain(pool);
    pthread_mutex_destroy(&pool->mu);
    free(pool->suffix);
    free(pool);
}

uint64_t chunk_pool_bytes(chunk_pool *pool) {
    if (pool == NULL) return 0;
    pthread_mutex_lock(&pool->mu);
    uint64_t bytes = pool->bytes;
    pthread_mutex_unlock(&pool->mu);
    return bytes;
}

int chunk_pool_put(chunk_pool *pool, int root_fd, const char *dir_rel, int dir_fd,
                    const char *name) {
    pthread_mutex_lock(&pool->mu);
    int full = pool->count + pool->putting >= POOL_MAX_FILES || pool->bytes >= pool->max_bytes;
    pthread_mutex_unlock(&pool->mu);
    if (full) return -1; /* without a stat */
    struct stat st;
    if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return errno;
    if (!S_ISREG(st.st_mode) || st.st_nlink != 1) return -1;
    pthread_mutex_lock(&pool->mu); /* a place and the bytes held while it is renamed */
    int room = pool->count + pool->putting < POOL_MAX_FILES &&
               pool->bytes + (uint64_t)st.st_size <= pool->max_bytes;
    if (room) {
        pool->bytes += (uint64_t)st.st_size;
        pool->putting++;
    }
    pthread_mutex_unlock(&pool->mu);
    if (!room) return -1;
    pooled_file f = {root_fd, strdup(dir_rel), malloc(strlen(name) + strlen(pool->suffix) + 1),
                     st.st_size};
    int err = -1;
    if (f.dir_rel && f.name) {
        strcat(strcpy(f.name, name), pool->suffix);
        if (syscall(SYS_renameat2, dir_fd, name, dir_fd, f.name, RENAME_NOREPLACE) == 0) err = 0;
        else if (errno != EEXIST && errno != EINVAL && errno != ENOSYS) err = errno;
    }
    pthread_mutex_lock(&pool->mu);
    pool->putting--;
    int listed = err == 0 && pool->max_bytes != 0; /* not drained meanwhile */
    if (listed) pool->files[pool->count++] = f;
    else pool->bytes -= (uint64_t)st.st_size;
    pthread_mutex_unlock(&pool->mu);
    if (!listed) {
        if (err == 0) unlinkat(dir_fd, f.name, 0);
        pooled_file_clear(&f);
    }
    return err;
}

int chunk_pool_take(chunk_pool *pool, int root_fd, off_t size, pooled_file *out) {
    int found = 0;
    pthread_mutex_lock(&pool->mu);
    for (size_t i = pool->count; i-- > 0;) {
        if (pool->files[i].root_fd == root_fd && pool->files[i].size == size) {
            *out = pool->files[i];
            pool->files[i] = pool->files[--pool->count];
            pool->bytes -= (uint64_t)size;
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&pool->mu);
    return found;
}

