/* krait: entry point. */
#define _POSIX_C_SOURCE 200809L /* uv.h names pthread types */
#include "alloc.h"
#include "cli.h"
#include "log.h"

#include <jansson.h>
#include <uv.h>

int main(int argc, char **argv)
{
    /* libuv's and jansson's memory through kr_malloc & co., before either allocates anything: counted
     * with the rest and reached by allocation-failure injection. libuv never calls realloc(p, 0) or
     * malloc(0) through the hook (it frees, or answers NULL, itself), and saves errno around free.
     * jansson's strings are freed with kr_oai_free. */
    uv_replace_allocator(kr_malloc, kr_realloc, kr_calloc, kr_free);
    json_set_alloc_funcs(kr_malloc, kr_free);
    kr_log_install_crash_handler(); /* a fault logs where it happened before it ends the process */
    return kr_cli_main(argc, argv);
}
