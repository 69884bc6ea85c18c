# Sourced by the peers' setup scripts, from the repository root, with the script's own arguments:
#   source scripts/peers/setup_steps.sh "$@"
# Their one flag: --dry-run (DRY_RUN=1: print each step instead of running it); --help prints the
# script's header comment. Defines run, which prints a step and runs it unless --dry-run.
DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "$(basename "$0"): unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done

run() {  # prints each step; runs it unless --dry-run
    echo "+ $*"
    [ "$DRY_RUN" = 1 ] || "$@"
}
