#pragma once
/* The `krait` command line: subcommands generate and logprobs (serve arrives with the HTTP
 * server). kr_cli_main parses argv and runs one subcommand; returns the process exit code. */

int kr_cli_main(int argc, char **argv);
