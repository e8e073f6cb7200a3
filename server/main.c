/* krait: entry point. */
#include "cli.h"

int main(int argc, char **argv)
{
    return kr_cli_main(argc, argv);
}
