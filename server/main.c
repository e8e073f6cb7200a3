/* krait: entry point. */
#include "alloc.h"
#include "cli.h"
#include "log.h"

#include <jansson.h>

int main(int argc, char **argv)
{
    /* jansson's memory through kr_malloc/kr_free, before any JSON exists: counted with the rest and
     * reached by allocation-failure injection; its strings are freed with kr_oai_free */
    json_set_alloc_funcs(kr_malloc, kr_free);
    kr_log_install_crash_handler(); /* a fault logs where it happened before it ends the process */
    return kr_cli_main(argc, argv);
}
