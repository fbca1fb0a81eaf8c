# The logic of the simulated nvidia-smi. ARGV[1] is the inventory (minor, uuid, name,
# pci bus id, memory MiB; tab-separated), ARGV[2] the visible nodes as `stat -c '%F|%t|%T'`
# lines, ARGV[3] the MIG instances (share/mig.tsv), ARGV[4..] the user's arguments.
# Everything happens in BEGIN.

function hex2dec(h,    i, d) {
    h = tolower(h); d = 0
    for (i = 1; i <= length(h); i++) d = d * 16 + index("0123456789abcdef", substr(h, i, 1)) - 1
    return d
}

function fail(message, code) {
    # nvidia-smi prints its errors on stdout.
    print message
    exit_code = code
    exit code
}

function usage() {
    print "nvidia-smi (simulated GPU host)"
    print "  -L, --list-gpus               list the visible GPUs"
    print "  -i, --id=ID[,ID...]           select GPUs by index, UUID or PCI bus id"
    print "  --query-gpu=FIELD[,FIELD...]  query fields: " supported
    print "  --format=csv[,noheader][,nounits]"
}

function bus_key(b) {
    # 00000000:18:00.0 and 0000:18:00.0 name the same device.
    b = tolower(b); sub(/^0+:/, ":", b); sub(/^0+/, "", b)
    return b
}

function selected(i,    k, want) {
    if (ids == "") return 1
    for (k = 1; k <= nid; k++) {
        want = idlist[k]
        if (want == (i - 1) "" || want == uuid[i] || bus_key(want) == bus_key(bus[i])) return 1
    }
    return 0
}

function value(field, i,    v) {
    if (field == "index") return i - 1
    if (field == "uuid" || field == "gpu_uuid") return uuid[i]
    if (field == "name" || field == "gpu_name") return name[i]
    if (field == "pci.bus_id" || field == "gpu_bus_id") return bus[i]
    if (field == "count") return n
    if (field == "driver_version") return "simulated"
    if (field == "memory.total" || field == "memory.free") return mem[i] (nounits ? "" : " MiB")
    if (field == "memory.used") return 0 (nounits ? "" : " MiB")
    return ""
}

function header(field) {
    if (field ~ /^memory\./) return field " [MiB]"
    return field
}

BEGIN {
    # No minor_number: the real nvidia-smi has no such field (the minor is in /proc/driver/nvidia).
    supported = "index,uuid,gpu_uuid,name,gpu_name,pci.bus_id,gpu_bus_id,count,driver_version,memory.total,memory.free,memory.used"
    split(supported, tmp, ","); for (k in tmp) known[tmp[k]] = 1

    # The MIG instances: gpu minor, index, gi, ci, profile, uuid, gi cap minor, ci cap minor.
    # The simulated host's majors (its header): of local use, which no driver registers.
    caps_major = -1; gpu_major = -1; nmig = 0
    while ((getline line < ARGV[3]) > 0) {
        if (line ~ /^#/) {
            if (match(line, /caps major [0-9]+/)) caps_major = substr(line, RSTART + 11, RLENGTH - 11) + 0
            if (match(line, /gpu major [0-9]+/)) gpu_major = substr(line, RSTART + 10, RLENGTH - 10) + 0
            continue
        }
        if (line == "") continue
        nmig++; split(line, f, "\t")
        mig_gpu[nmig] = f[1] + 0; mig_profile[nmig] = f[5]; mig_uuid[nmig] = f[6]
        mig_gi_cap[nmig] = f[7] + 0; mig_ci_cap[nmig] = f[8] + 0
    }

    nl = split(ARGV[2], lines, "\n")
    for (k = 1; k <= nl; k++) {
        split(lines[k], part, "|")
        if (part[1] != "character special file") continue
        if (hex2dec(part[2]) == gpu_major) visible[hex2dec(part[3])] = 1
        else if (hex2dec(part[2]) == caps_major) visible_cap[hex2dec(part[3])] = 1
    }

    mode = "table"; query = ""; format = ""; ids = ""
    for (a = 4; a < ARGC; a++) {
        arg = ARGV[a]
        if (arg == "-L" || arg == "--list-gpus") mode = "list"
        else if (arg == "-h" || arg == "--help") { usage(); exit 0 }
        else if (arg == "-i" || arg == "--id") ids = ARGV[++a]
        else if (arg ~ /^--id=/) ids = substr(arg, 6)
        else if (arg ~ /^-i[^-]/) ids = substr(arg, 3)
        else if (arg == "--query-gpu") { mode = "query"; query = ARGV[++a] }
        else if (arg ~ /^--query-gpu=/) { mode = "query"; query = substr(arg, 13) }
        else if (arg == "--format") format = ARGV[++a]
        else if (arg ~ /^--format=/) format = substr(arg, 10)
        else fail("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.", 2)
    }
    nid = split(ids, idlist, ",")
    if (!(255 in visible))
        fail("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\n", 9)

    n = 0
    while ((getline line < ARGV[1]) > 0) {
        if (line == "" || line ~ /^#/) continue
        split(line, f, "\t")
        if (!((f[1] + 0) in visible)) continue
        n++; minor[n] = f[1] + 0; uuid[n] = f[2]; name[n] = f[3]; bus[n] = f[4]; mem[n] = f[5]
    }
    # Number the visible GPUs from 0 in PCI bus order, as nvidia-smi does.
    for (i = 2; i <= n; i++)
        for (j = i; j > 1 && bus[j - 1] > bus[j]; j--) {
            t = minor[j]; minor[j] = minor[j - 1]; minor[j - 1] = t
            t = uuid[j]; uuid[j] = uuid[j - 1]; uuid[j - 1] = t
            t = name[j]; name[j] = name[j - 1]; name[j - 1] = t
            t = bus[j]; bus[j] = bus[j - 1]; bus[j - 1] = t
            t = mem[j]; mem[j] = mem[j - 1]; mem[j - 1] = t
        }

    if (mode == "query") {
        if (format !~ /^csv(,(noheader|nounits))*$/)
            fail("'--format' requires 'csv' (optionally ',noheader' and ',nounits').", 2)
        noheader = format ~ /noheader/; nounits = format ~ /nounits/
        nf = split(query, fields, ",")
        for (k = 1; k <= nf; k++) {
            gsub(/ /, "", fields[k])
            if (!(fields[k] in known))
                fail("Field \"" fields[k] "\" is not a valid field to query.", 2)
        }
    }
    shown = 0
    for (i = 1; i <= n; i++) if (selected(i)) shown++
    if (shown == 0) fail("No devices were found", 6)

    if (mode == "query" && !noheader) {
        out = ""
        for (k = 1; k <= nf; k++) out = out (k > 1 ? ", " : "") header(fields[k])
        print out
    }
    if (mode == "table") {
        print "+-----------------------------------------------------------------------------+"
        print "| NVIDIA-SMI simulated     Driver Version: simulated     CUDA Version: N/A     |"
        print "| GPU  Name                             Bus-Id            Memory-Usage         |"
        print "+-----------------------------------------------------------------------------+"
    }
    for (i = 1; i <= n; i++) {
        if (!selected(i)) continue
        if (mode == "list") {
            printf "GPU %d: %s (UUID: %s)\n", i - 1, name[i], uuid[i]
            # Its MIG instances whose GPU and compute instance cap nodes are both here,
            # numbered from 0 as the ones this sandbox can use.
            shown_mig = 0
            for (m = 1; m <= nmig; m++)
                if (mig_gpu[m] == minor[i] && (mig_gi_cap[m] in visible_cap) && (mig_ci_cap[m] in visible_cap))
                    printf "  MIG %-11s Device %2d: (UUID: %s)\n", mig_profile[m], shown_mig++, mig_uuid[m]
        }
        else if (mode == "table")
            printf "| %3d  %-32s %-17s %6d MiB / %6d MiB |\n", i - 1, name[i], bus[i], 0, mem[i]
        else {
            out = ""
            for (k = 1; k <= nf; k++) out = out (k > 1 ? ", " : "") value(fields[k], i)
            print out
        }
    }
    exit 0
}
