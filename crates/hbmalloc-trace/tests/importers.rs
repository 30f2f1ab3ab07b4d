//! Importers on small synthetic inputs: what they produce, and how they refuse
//! bad input (always with a one-line error, never a panic).

use hbmalloc_trace::pickle::{self, Value};
use hbmalloc_trace::{
    parse_bytes, InitialBlock, InitialBlockState, InitialSegment, Op, SegmentEventKind, Trace,
    DEFERRED_FREE_STREAM_BASE,
};

const MIB: u64 = 1 << 20;

/// Just enough of Python's data model to write test pickles.
#[derive(Clone)]
enum Py {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'static str),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Dict(Vec<(&'static str, Py)>),
}

impl Py {
    fn int(n: u64) -> Py {
        Py::Int(n.into())
    }

    /// Encodes as a protocol-4 pickle, the way `pickle.dumps` writes plain data.
    fn dump(&self) -> Vec<u8> {
        let mut out = vec![0x80, 4];
        self.write(&mut out);
        out.push(b'.');
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Py::None => out.push(b'N'),
            Py::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
            Py::Int(n) => {
                if let Ok(small) = i32::try_from(*n) {
                    out.push(b'J');
                    out.extend(small.to_le_bytes());
                } else {
                    // LONG1: shortest little-endian two's complement.
                    let bytes = n.to_le_bytes();
                    let mut len = 16;
                    while len > 1 {
                        let (top, next) = (bytes[len - 1], bytes[len - 2]);
                        let redundant =
                            (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                        if !redundant {
                            break;
                        }
                        len -= 1;
                    }
                    out.extend([0x8a, len as u8]);
                    out.extend(&bytes[..len]);
                }
            }
            Py::Float(x) => {
                out.push(b'G');
                out.extend(x.to_be_bytes());
            }
            Py::Str(s) => {
                out.push(b'X');
                out.extend((s.len() as u32).to_le_bytes());
                out.extend(s.as_bytes());
            }
            Py::List(items) => {
                out.extend([b']', 0x94, b'(']);
                items.iter().for_each(|item| item.write(out));
                out.push(b'e');
            }
            Py::Tuple(items) => {
                out.push(b'(');
                items.iter().for_each(|item| item.write(out));
                out.push(b't');
            }
            Py::Dict(pairs) => {
                out.extend([b'}', 0x94, b'(']);
                for (key, value) in pairs {
                    Py::Str(key).write(out);
                    value.write(out);
                }
                out.push(b'u');
            }
        }
    }
}

fn block(address: u64, size: u64, requested: u64, state: &'static str) -> Py {
    Py::Dict(vec![
        ("address", Py::int(address)),
        ("size", Py::int(size)),
        ("requested_size", Py::int(requested)),
        ("state", Py::Str(state)),
    ])
}

/// A segment whose `segment_type` its size says, as PyTorch's are.
fn segment(address: u64, size: u64, expandable: bool, blocks: Vec<Py>) -> Py {
    let kind = if size == 2 * MIB { "small" } else { "large" };
    segment_of_type(address, size, Some(kind), expandable, blocks)
}

/// A segment of `segment_type` `kind`, or with none (older files).
fn segment_of_type(
    address: u64,
    size: u64,
    kind: Option<&'static str>,
    expandable: bool,
    blocks: Vec<Py>,
) -> Py {
    let mut pairs = vec![
        ("device", Py::int(0)),
        ("address", Py::int(address)),
        ("total_size", Py::int(size)),
        ("stream", Py::int(0)),
        ("is_expandable", Py::Bool(expandable)),
        ("blocks", Py::List(blocks)),
    ];
    if let Some(kind) = kind {
        pairs.push(("segment_type", Py::Str(kind)));
    }
    Py::Dict(pairs)
}

fn entry(action: &'static str, addr: u64, size: u64) -> Py {
    Py::Dict(vec![
        ("action", Py::Str(action)),
        ("addr", Py::int(addr)),
        ("size", Py::int(size)),
        ("stream", Py::int(0)),
        ("frames", Py::List(vec![])),
    ])
}

fn snapshot(segments: Vec<Py>, trace: Vec<Py>) -> Py {
    Py::Dict(vec![
        ("segments", Py::List(segments)),
        ("device_traces", Py::List(vec![Py::List(trace)])),
    ])
}

fn import(name: &str, bytes: &[u8]) -> Trace {
    parse_bytes(name, bytes).unwrap_or_else(|e| panic!("{e}"))
}

fn import_error(bytes: &[u8]) -> String {
    match parse_bytes("bad.bin", bytes) {
        Ok(trace) => panic!("expected an error, got {trace:?}"),
        Err(e) => e.to_string(),
    }
}

fn free(size: u64) -> InitialBlock {
    InitialBlock {
        size,
        requested_size: 0,
        state: InitialBlockState::Free,
    }
}

#[test]
fn pickle_round_trips_plain_data() {
    let value = Py::Dict(vec![
        ("none", Py::None),
        ("yes", Py::Bool(true)),
        ("small", Py::Int(-5)),
        ("address", Py::Int(0x7f00_0000_0000)),
        ("negative_long", Py::Int(-(1 << 40))),
        ("float", Py::Float(0.5)),
        ("pair", Py::Tuple(vec![Py::int(1), Py::Str("é")])),
    ]);
    let doc = pickle::parse(&value.dump()).unwrap();
    let get = |key| doc.get(doc.dict_get(doc.root(), key).unwrap());
    assert_eq!(get("none"), &Value::None);
    assert_eq!(get("yes"), &Value::Bool(true));
    assert_eq!(get("small"), &Value::Int(-5));
    assert_eq!(get("address"), &Value::Int(0x7f00_0000_0000));
    assert_eq!(get("negative_long"), &Value::Int(-(1 << 40)));
    assert_eq!(get("float"), &Value::Float(0.5));
    let Value::Tuple(pair) = get("pair") else {
        panic!("not a tuple")
    };
    assert_eq!(doc.get(pair[1]), &Value::Str("é".into()));
}

#[test]
fn pickle_memo_aliases_containers_filled_after_memoizing() {
    // l = []; memoize; d = {"a": l, "b": l}; then l.append(7) via the memo.
    // {  MEMOIZE  (  "a"  ]  MEMOIZE  "b"  GET 1  u  GET 1  K 7  a  0(pop)  .
    let mut bytes = vec![0x80, 4, b'}', 0x94, b'('];
    bytes.extend([0x8c, 1, b'a', b']', 0x94, 0x8c, 1, b'b', b'h', 1, b'u']);
    bytes.extend([b'h', 1, b'K', 7, b'a', b'0', b'.']);
    let doc = pickle::parse(&bytes).unwrap();
    let a = doc.dict_get(doc.root(), "a").unwrap();
    let b = doc.dict_get(doc.root(), "b").unwrap();
    assert_eq!(a, b, "both keys name the same list");
    let Value::List(items) = doc.get(a) else {
        panic!("not a list")
    };
    assert_eq!(doc.get(items[0]), &Value::Int(7));
}

/// A windowed snapshot exercising every rebuild rule; see the comments.
#[test]
fn snapshot_window_rebuild_and_ops() {
    let s1 = 0x1000_0000; // small segment, lives throughout
    let s2 = 0x2000_0000; // freed in the window (empty_cache)
    let s3 = 0x3000_0000; // freed in the same empty_cache
    let s4 = 0x4000_0000; // allocated in the window
    let s5 = 0x5000_0000; // freed by the OOM retry
    let trace = vec![
        // B was allocated before the window and is freed in it.
        entry("free_requested", s1 + 512, 600),
        entry("free_completed", s1 + 512, 600),
        entry("segment_free", s2, 20 * MIB),
        entry("segment_free", s3, 2 * MIB),
        entry("alloc", s1, 100),
        entry("segment_alloc", s4, 20 * MIB),
        entry("alloc", s4, 5 * MIB),
        // C's free is deferred until another stream's work on it completes.
        entry("free_requested", s4, 5 * MIB),
        entry("alloc", s1 + 1024, 200),
        entry("free_completed", s4, 5 * MIB),
        entry("annotate", 0, 0),
        entry("segment_free", s5, 2 * MIB),
        Py::Dict(vec![
            ("action", Py::Str("oom")),
            ("device_free", Py::int(12345)),
            ("size", Py::int(1 << 30)),
            ("stream", Py::int(0)),
        ]),
        entry("mystery", 0, 0),
    ];
    let segments = vec![
        segment(
            s1,
            2 * MIB,
            false,
            vec![
                block(s1, 512, 100, "active_allocated"),
                block(s1 + 512, 512, 0, "inactive"),
                block(s1 + 1024, 512, 200, "active_allocated"),
                block(s1 + 1536, 2 * MIB - 1536, 0, "inactive"),
            ],
        ),
        segment(
            s4,
            20 * MIB,
            false,
            vec![block(s4, 20 * MIB, 0, "inactive")],
        ),
    ];
    let trace = import("window.pickle", &snapshot(segments, trace).dump());
    assert_eq!(trace.source, "window.pickle");
    assert_eq!(trace.devices.len(), 1);
    let device = &trace.devices[0];

    let small = |address, blocks| InitialSegment {
        address,
        stream: 0,
        small_pool: true,
        expandable: false,
        blocks,
    };
    let b = InitialBlock {
        size: 1024, // 600 rounded up to 512 bytes, as PyTorch does
        requested_size: 600,
        state: InitialBlockState::Allocated(0),
    };
    assert_eq!(
        device.initial_segments,
        vec![
            small(s1, vec![free(512), b, free(2 * MIB - 1536)]),
            InitialSegment {
                small_pool: false,
                ..small(s2, vec![free(20 * MIB)])
            },
            small(s3, vec![free(2 * MIB)]),
            small(s5, vec![free(2 * MIB)]),
        ]
    );

    let deferred = DEFERRED_FREE_STREAM_BASE | 2;
    assert_eq!(
        device.ops,
        vec![
            Op::Free { id: 0 },
            Op::EmptyCache, // once for the run of two segment frees
            Op::Alloc {
                id: 1,
                size: 100,
                stream: 0
            },
            Op::Alloc {
                id: 2,
                size: 5 * MIB,
                stream: 0
            },
            Op::RecordStream {
                id: 2,
                stream: deferred
            },
            Op::Free { id: 2 },
            Op::Alloc {
                id: 3,
                size: 200,
                stream: 0
            },
            Op::StreamComplete { stream: deferred },
            // No EmptyCache: the OOM retry explains the last segment free.
            Op::Oom {
                size: 1 << 30,
                stream: 0,
                device_free: 12345
            },
        ]
    );

    let recorded = device.recorded.as_ref().unwrap();
    assert_eq!(recorded.initial_reserved_bytes, 26 * MIB);
    assert_eq!(recorded.peak_reserved_bytes, Some(26 * MIB));
    let events: Vec<_> = recorded
        .segment_events
        .iter()
        .map(|e| (e.kind, e.size, e.op_index))
        .collect();
    assert_eq!(
        events,
        vec![
            // Released during the EmptyCache op (index 1).
            (SegmentEventKind::Free, 20 * MIB, 1),
            (SegmentEventKind::Free, 2 * MIB, 1),
            (SegmentEventKind::Alloc, 20 * MIB, 3),
            (SegmentEventKind::Free, 2 * MIB, 8),
        ]
    );
    assert_eq!(device.recorded_config, None);
    assert!(!device.foreign_allocator);
    assert_eq!(device.skipped.get("unknown action 'mystery'"), Some(&1));
}

#[test]
fn snapshot_block_pending_at_window_start_is_freed_behind_a_stream() {
    let base = 0x1000_0000;
    let segments = vec![segment(
        base,
        2 * MIB,
        false,
        vec![block(base, 2 * MIB, 0, "inactive")],
    )];
    let trace = vec![entry("free_completed", base, 1000)];
    let device = &import("pending.pickle", &snapshot(segments, trace).dump()).devices[0];
    assert_eq!(
        device.initial_segments[0].blocks[0].state,
        InitialBlockState::Allocated(0)
    );
    let stream = DEFERRED_FREE_STREAM_BASE;
    assert_eq!(
        device.ops,
        vec![
            Op::RecordStream { id: 0, stream },
            Op::Free { id: 0 },
            Op::StreamComplete { stream },
        ]
    );
}

/// A `free_requested` is a plain free only when its own `free_completed`
/// comes next; another block's completion between them leaves it pending.
#[test]
fn snapshot_free_requested_completes_only_with_its_own_block() {
    let (a, b) = (0x100, 0x900);
    let trace = vec![
        entry("alloc", a, 512),
        entry("alloc", b, 512),
        entry("free_requested", b, 512),
        entry("free_requested", a, 512),
        entry("free_completed", b, 512),
        entry("free_completed", a, 512),
    ];
    let device = &import("pending.pickle", &snapshot(vec![], trace).dump()).devices[0];
    let (sa, sb) = (DEFERRED_FREE_STREAM_BASE, DEFERRED_FREE_STREAM_BASE | 1);
    let alloc = |id| Op::Alloc {
        id,
        size: 512,
        stream: 0,
    };
    assert_eq!(
        device.ops,
        vec![
            alloc(0),
            alloc(1),
            Op::RecordStream { id: 1, stream: sb },
            Op::Free { id: 1 },
            Op::RecordStream { id: 0, stream: sa },
            Op::Free { id: 0 },
            Op::StreamComplete { stream: sb },
            Op::StreamComplete { stream: sa },
        ]
    );
}

#[test]
fn snapshot_expandable_unmap_rejoins_the_mapped_range() {
    let base = 0x7000_0000;
    let segments = vec![segment(
        base,
        40 * MIB,
        true,
        vec![
            block(base, 20 * MIB, 20 * MIB, "active_allocated"),
            block(base + 20 * MIB, 20 * MIB, 0, "inactive"),
        ],
    )];
    let trace = vec![entry("segment_unmap", base + 40 * MIB, 20 * MIB)];
    let device = &import("expandable.pickle", &snapshot(segments, trace).dump()).devices[0];
    assert_eq!(device.initial_segments.len(), 1);
    let initial = &device.initial_segments[0];
    assert!(initial.expandable);
    assert_eq!(initial.total_size(), 60 * MIB);
    assert_eq!(device.ops, vec![Op::EmptyCache]);
    // No allocator_settings, but expandable segments say what the config was.
    assert_eq!(
        device.recorded_config.as_deref(),
        Some("expandable_segments:True")
    );
}

/// Undoing the window's segment events, latest first: an unmap's range
/// joins the touching expandable segment of its own pool (never a plain
/// segment, another pool or one it does not touch), a map's range leaves a
/// gap in the middle of a segment, and a freed plain segment takes its pool
/// from its size.
#[test]
fn snapshot_segment_events_rebuild_each_range_with_its_pool() {
    let base = 0x7000_0000;
    let typed = |address: u64, size: u64, kind: &'static str, expandable: bool| {
        let free = vec![block(address, size, 0, "inactive")];
        segment_of_type(address, size, Some(kind), expandable, free)
    };
    let segments = vec![
        typed(base, 20 * MIB, "small", true),
        typed(base + 40 * MIB, 20 * MIB, "large", true),
        typed(base + 80 * MIB, 20 * MIB, "large", false),
        typed(base + 130 * MIB, 10 * MIB, "large", true),
    ];
    let trace = vec![
        entry("segment_unmap", base + 150 * MIB, 10 * MIB),
        entry("segment_map", base + 4 * MIB, 4 * MIB),
        entry("segment_free", base + 100 * MIB, 2 * MIB),
        entry("segment_unmap", base + 60 * MIB, 20 * MIB),
        entry("segment_unmap", base + 20 * MIB, 20 * MIB),
    ];
    let device = &import("ranges.pickle", &snapshot(segments, trace).dump()).devices[0];
    let layout: Vec<(u64, u64, bool, bool)> = device
        .initial_segments
        .iter()
        .map(|s| {
            (
                (s.address - base) / MIB,
                s.total_size() / MIB,
                s.small_pool,
                s.expandable,
            )
        })
        .collect();
    assert_eq!(
        layout,
        vec![
            (0, 4, true, true),
            (8, 32, true, true),
            (40, 40, false, true),
            (80, 20, false, false),
            (100, 2, true, false),
            (130, 10, false, true),
            (150, 10, false, true),
        ]
    );
}

/// A block the history frees, larger than the room the dump leaves it
/// before the next live block, is cut to that room: blocks never overlap.
#[test]
fn snapshot_block_freed_in_the_window_is_cut_to_the_room_before_the_next() {
    let base = 0x1000_0000;
    let segments = vec![segment(
        base,
        2 * MIB,
        false,
        vec![
            block(base, 512, 0, "inactive"),
            block(base + 512, 512, 512, "active_allocated"),
            block(base + 1024, 2 * MIB - 1024, 0, "inactive"),
        ],
    )];
    let trace = vec![entry("free", base, 1000)];
    let device = &import("overlap.pickle", &snapshot(segments, trace).dump()).devices[0];
    let sizes: Vec<u64> = device.initial_segments[0]
        .blocks
        .iter()
        .map(|b| b.size)
        .collect();
    assert_eq!(sizes, vec![512, 512, 2 * MIB - 1024]);
}

#[test]
fn snapshot_settings_render_only_non_default_keys() {
    let with = |settings| {
        let mut root = match snapshot(vec![], vec![entry("alloc", 0x100, 8)]) {
            Py::Dict(pairs) => pairs,
            _ => unreachable!(),
        };
        root.push(("allocator_settings", settings));
        import("settings.pickle", &Py::Dict(root).dump()).devices[0]
            .recorded_config
            .clone()
    };
    let defaults = || {
        vec![
            ("max_split_size", Py::Int(-1)),
            ("garbage_collection_threshold", Py::Float(0.0)),
            ("expandable_segments", Py::Bool(false)),
            (
                "roundup_power2_divisions",
                Py::Dict(vec![("1", Py::int(0))]),
            ),
        ]
    };
    assert_eq!(with(Py::Dict(defaults())), Some(String::new()));
    // No limit, written as SIZE_MAX rather than -1.
    let mut unlimited = defaults();
    unlimited[0].1 = Py::int(u64::MAX);
    assert_eq!(with(Py::Dict(unlimited)), Some(String::new()));
    // Divisions as one number for every size: none when 0.
    for (n, rendered) in [(0, ""), (4, "roundup_power2_divisions:[>:4]")] {
        let mut one = defaults();
        one[3].1 = Py::int(n);
        assert_eq!(with(Py::Dict(one)).as_deref(), Some(rendered));
    }
    let mut custom = defaults();
    custom[0].1 = Py::int(256 * MIB);
    custom[2].1 = Py::Bool(true);
    custom[3].1 = Py::Dict(vec![("1", Py::int(0)), ("256", Py::int(4))]);
    assert_eq!(
        with(Py::Dict(custom)).as_deref(),
        Some("max_split_size_mb:256,expandable_segments:True,roundup_power2_divisions:[256:4]")
    );
}

#[test]
fn snapshot_devices_are_ordered_and_torch_npu_is_detected() {
    let mut on_device_1 = segment(0x9000_0000, 2 * MIB, false, vec![]);
    if let Py::Dict(pairs) = &mut on_device_1 {
        pairs[0].1 = Py::int(1);
    }
    let npu_entry = Py::Dict(vec![
        ("action", Py::Str("alloc")),
        ("addr", Py::int(0x100)),
        ("size", Py::int(8)),
        ("stream", Py::int(0)),
        (
            "frames",
            Py::List(vec![Py::Dict(vec![(
                "filename",
                Py::Str("/site-packages/torch_npu/utils/_module.py"),
            )])]),
        ),
    ]);
    let trace = import(
        "npu.pickle",
        &snapshot(vec![on_device_1], vec![npu_entry]).dump(),
    );
    let devices: Vec<i64> = trace.devices.iter().map(|d| d.device).collect();
    assert_eq!(devices, vec![0, 1]);
    assert!(trace.devices.iter().all(|d| d.foreign_allocator));
    assert_eq!(
        trace.devices[1].initial_segments[0].blocks,
        vec![free(2 * MIB)]
    );
}

/// `torch.cuda.memory_snapshot()` returns the segment list alone, and
/// `torch/cuda/_memory_viz.py` reads such a pickle as a snapshot without history.
#[test]
fn snapshot_root_list_is_segments_without_history() {
    let base = 0x1000_0000;
    let segments = Py::List(vec![segment(
        base,
        2 * MIB,
        false,
        vec![
            block(base, 512, 100, "active_allocated"),
            block(base + 512, 2 * MIB - 512, 0, "inactive"),
        ],
    )]);
    let trace = import("segments.pickle", &segments.dump());
    assert_eq!(trace.devices.len(), 1);
    let device = &trace.devices[0];
    assert!(device.ops.is_empty());
    assert_eq!(device.initial_segments[0].total_size(), 2 * MIB);
    assert_eq!(
        device.initial_segments[0].blocks[0].state,
        InitialBlockState::Allocated(0)
    );
    assert!(import_error(&Py::Int(3).dump()).contains("expected a dict or a list of segments"));
}

/// A snapshot dumped without `_record_memory_history` has segments and no
/// `device_traces`: it imports as the dumped state with no ops (documented
/// in `snapshot_to_trace`), not as an error.
#[test]
fn snapshot_without_history_keeps_the_dumped_state_and_no_ops() {
    let base = 0x1000_0000;
    let root = Py::Dict(vec![(
        "segments",
        Py::List(vec![segment(
            base,
            20 * MIB,
            false,
            vec![block(base, 20 * MIB, 0, "inactive")],
        )]),
    )]);
    let trace = import("state.pickle", &root.dump());
    let device = &trace.devices[0];
    assert!(device.ops.is_empty());
    assert_eq!(device.initial_segments[0].blocks, vec![free(20 * MIB)]);
    let recorded = device.recorded.as_ref().unwrap();
    assert_eq!(recorded.initial_reserved_bytes, 20 * MIB);
    assert!(recorded.segment_events.is_empty());
}

/// The dumped state's block states (both names of a block whose free waits
/// on a stream are live), and a segment that gives no `segment_type`: small
/// when it has the small pool's size.
#[test]
fn snapshot_reads_pending_blocks_as_live_and_a_segment_type_from_its_size() {
    let (small, large) = (0x1000_0000, 0x2000_0000);
    let untyped = |address: u64, size: u64, state: &'static str| {
        segment_of_type(
            address,
            size,
            None,
            false,
            vec![block(address, size, size, state)],
        )
    };
    let root = Py::Dict(vec![(
        "segments",
        Py::List(vec![
            untyped(small, 2 * MIB, "active_pending_free"),
            untyped(large, 20 * MIB, "active_awaiting_free"),
        ]),
    )]);
    let device = &import("state.pickle", &root.dump()).devices[0];
    let pools: Vec<bool> = device
        .initial_segments
        .iter()
        .map(|s| s.small_pool)
        .collect();
    assert_eq!(pools, vec![true, false]);
    for segment in &device.initial_segments {
        // One block fills the segment: no free block of 0 bytes after it.
        assert_eq!(segment.blocks.len(), 1, "{segment:?}");
        assert!(
            matches!(segment.blocks[0].state, InitialBlockState::Allocated(_)),
            "{segment:?}"
        );
    }
}

/// A block the history frees that lies in no dumped segment gets a segment
/// of its own, in the pool its size would take.
#[test]
fn snapshot_block_outside_every_segment_gets_one_of_its_pool() {
    let trace = vec![entry("free", 0x900, 8), entry("free", 0x4000_0000, 4 * MIB)];
    let device = &import("outside.pickle", &snapshot(vec![], trace).dump()).devices[0];
    let pools: Vec<(u64, bool)> = device
        .initial_segments
        .iter()
        .map(|s| (s.address, s.small_pool))
        .collect();
    assert_eq!(pools, vec![(0x900, true), (0x4000_0000, false)]);
    assert_eq!(
        device
            .skipped
            .get("live block outside every segment (given its own segment)"),
        Some(&2)
    );
}

/// Blocks outside every segment may add up past 2^64 bytes (two absurd
/// frees): the reserved bytes they stand for saturate rather than overflow.
#[test]
fn snapshot_blocks_outside_every_segment_past_2_64_bytes_saturate() {
    let trace = vec![
        entry("free", 0x1000, 1 << 63),
        entry("free", 0x2000, 1 << 63),
    ];
    let device = &import("absurd.pickle", &snapshot(vec![], trace).dump()).devices[0];
    assert_eq!(device.initial_segments.len(), 2);
    let recorded = device.recorded.as_ref().unwrap();
    assert_eq!(recorded.initial_reserved_bytes, u64::MAX);
    assert_eq!(recorded.peak_reserved_bytes, Some(u64::MAX));
}

/// Markers in the history carry no address or size, and are no ops.
#[test]
fn snapshot_markers_need_no_address() {
    let marker = |action| Py::Dict(vec![("action", Py::Str(action))]);
    let trace = vec![
        marker("snapshot"),
        entry("alloc", 0x100, 8),
        marker("annotate"),
        marker("some_future_action"),
    ];
    let device = &import("markers.pickle", &snapshot(vec![], trace).dump()).devices[0];
    assert_eq!(
        device.ops,
        vec![Op::Alloc {
            id: 0,
            size: 8,
            stream: 0
        }]
    );
}

/// torch 2.0's format (`THCPModule_memorySnapshot` with `History`): blocks
/// carry `size`, `state` and `history` (`addr`, `real_size`, `frames`) but no
/// `address` or `requested_size`; entries have no `time_us`.
#[test]
fn snapshot_legacy_blocks_take_the_requested_size_from_history() {
    let base = 0x1000_0000;
    let legacy_block = |size, state, real_size: Option<u64>| {
        let mut pairs = vec![("size", Py::int(size)), ("state", Py::Str(state))];
        if let Some(real_size) = real_size {
            pairs.push((
                "history",
                Py::List(vec![Py::Dict(vec![
                    ("addr", Py::int(base)),
                    ("real_size", Py::int(real_size)),
                    ("frames", Py::List(vec![])),
                ])]),
            ));
        }
        Py::Dict(pairs)
    };
    let legacy_segment = Py::Dict(vec![
        ("device", Py::int(0)),
        ("address", Py::int(base)),
        ("total_size", Py::int(2 * MIB)),
        ("allocated_size", Py::int(1024)),
        ("active_size", Py::int(1536)),
        ("stream", Py::int(0)),
        ("segment_type", Py::Str("small")),
        (
            "blocks",
            Py::List(vec![
                legacy_block(1024, "active_allocated", Some(1000)),
                // The docstring's name for active_pending_free.
                legacy_block(512, "active_awaiting_free", Some(300)),
                legacy_block(2 * MIB - 1536, "inactive", None),
            ]),
        ),
    ]);
    let trace_entry = Py::Dict(vec![
        ("action", Py::Str("free_completed")),
        ("addr", Py::int(base + 1024)),
        ("size", Py::int(300)),
        ("stream", Py::int(0)),
    ]);
    let device = &import(
        "legacy.pickle",
        &snapshot(vec![legacy_segment], vec![trace_entry]).dump(),
    )
    .devices[0];
    let blocks = &device.initial_segments[0].blocks;
    assert_eq!(blocks[0].requested_size, 1000);
    assert_eq!(blocks[1].requested_size, 300);
    // The pending block's free completes in the window.
    let stream = DEFERRED_FREE_STREAM_BASE | 1;
    assert_eq!(
        device.ops,
        vec![
            Op::RecordStream { id: 1, stream },
            Op::Free { id: 1 },
            Op::StreamComplete { stream },
        ]
    );
    assert!(device.skipped.is_empty(), "{:?}", device.skipped);
}

/// `user_defined` entries (torch 2.4-era `TraceEntry::USER_DEFINED`) are
/// markers, and `free` (MemoryViz.js's name for a free that completed at
/// once) frees; neither is an unknown action.
#[test]
fn snapshot_user_defined_is_skipped_and_free_frees() {
    let trace = vec![
        entry("alloc", 0x100, 8),
        entry("user_defined", 0, 0),
        entry("free", 0x100, 8),
        entry("free", 0x900, 8),
    ];
    let device = &import("actions.pickle", &snapshot(vec![], trace).dump()).devices[0];
    assert_eq!(
        device.ops,
        vec![
            Op::Alloc {
                id: 1,
                size: 8,
                stream: 0
            },
            Op::Free { id: 1 },
            // Allocated before the window (outside any dumped segment).
            Op::Free { id: 0 },
        ]
    );
    assert!(
        !device
            .skipped
            .keys()
            .any(|k| k.starts_with("unknown action")),
        "{:?}",
        device.skipped
    );
}

/// [`entry`] of 512 bytes at `time_us`.
fn timed(action: &'static str, addr: u64, time_us: u64) -> Py {
    let Py::Dict(mut pairs) = entry(action, addr, 512) else {
        unreachable!()
    };
    pairs.push(("time_us", Py::int(time_us)));
    Py::Dict(pairs)
}

fn annotation(name: &'static str, stage: &'static str, time_us: u64) -> Py {
    Py::Dict(vec![
        ("stage", Py::Str(stage)),
        ("name", Py::Str(name)),
        ("device", Py::int(0)),
        ("time_us", Py::int(time_us)),
    ])
}

/// A step that begins after the last op (only a marker follows it) is not
/// in the recording: it marks nothing.
#[test]
fn snapshot_step_begun_after_the_last_op_marks_nothing() {
    let Py::Dict(mut root) = snapshot(
        vec![],
        vec![
            timed("alloc", 0x100, 10),
            timed("free", 0x100, 20),
            timed("snapshot", 0, 30),
        ],
    ) else {
        unreachable!()
    };
    let optimizer = "Optimizer.step#AdamW.step";
    root.push((
        "external_annotations",
        Py::List(vec![
            annotation(optimizer, "START", 15),
            annotation(optimizer, "START", 25),
        ]),
    ));
    let trace = import("late-step.pickle", &Py::Dict(root).dump());
    assert_eq!(trace.devices[0].ops.len(), 2);
    assert_eq!(trace.devices[0].step_starts, vec![1]);
}

/// Steps come from `external_annotations`: each optimizer step (of the
/// first optimizer named) begins one at the first entry at or after it;
/// torch.profiler's step ranges take precedence; what is not a step's start
/// (ends, other ranges, malformed entries, steps before the history or after
/// it) marks nothing.
#[test]
fn snapshot_annotations_mark_steps() {
    let history = vec![
        timed("alloc", 0x100, 10),
        timed("free", 0x100, 20),
        timed("alloc", 0x200, 30),
        timed("free", 0x200, 40),
        timed("alloc", 0x300, 50),
        timed("free", 0x300, 60),
    ];
    let with = |annotations: Vec<Py>| {
        let Py::Dict(mut root) = snapshot(vec![], history.clone()) else {
            unreachable!()
        };
        root.push(("external_annotations", Py::List(annotations)));
        let trace = import("steps.pickle", &Py::Dict(root).dump());
        assert_eq!(
            trace.devices[0].recorded_span_us,
            Some(50),
            "times 10 to 60"
        );
        trace.devices[0].step_starts.clone()
    };
    let optimizer = "Optimizer.step#AdamW.step";
    assert_eq!(
        with(vec![
            annotation(optimizer, "START", 5),
            annotation(optimizer, "START", 25),
            annotation(optimizer, "END", 26),
            annotation("Optimizer.zero_grad#AdamW.zero_grad", "START", 45),
            annotation("Optimizer.step#SGD.step", "START", 35),
            annotation(optimizer, "START", 50),
            Py::Dict(vec![("stage", Py::Str("START"))]),
            Py::Int(3),
            annotation(optimizer, "START", 70),
        ]),
        vec![2, 4],
        "ops 2 (time 30) and 4 (time 50); none before the history or after it"
    );
    assert_eq!(
        with(vec![
            annotation(optimizer, "START", 25),
            annotation("ProfilerStep#7", "START", 10),
            annotation("ProfilerStep#8", "START", 35),
            // Another device's step marks nothing here.
            Py::Dict(vec![
                ("stage", Py::Str("START")),
                ("name", Py::Str("ProfilerStep#8")),
                ("device", Py::int(1)),
                ("time_us", Py::int(15)),
            ]),
        ]),
        vec![0, 3],
        "the profiler's steps, where the program has them"
    );
    assert_eq!(
        with(vec![
            // Ranges before the first optimizer step do not name the optimizer.
            annotation("Optimizer.zero_grad#AdamW.zero_grad", "START", 15),
            annotation(optimizer, "START", 25),
        ]),
        vec![2]
    );
    assert_eq!(with(vec![]), Vec::<usize>::new());
    assert!(import_error(
        &Py::Dict(vec![
            ("segments", Py::List(vec![])),
            ("external_annotations", Py::Int(1)),
        ])
        .dump()
    )
    .contains("external_annotations"));
}

/// Writes `value` the way torch's C++ `Pickler` does for
/// `torch::cuda::_memory_snapshot_pickled` (protocol 2, `tag_aggregates`
/// off): `BINPUT` after every container and new string, `BINGET` for a
/// repeated string, `BININT1`/`BININT2`/`BININT`/8-byte `LONG1` ints.
fn dump_like_torch_jit(value: &Py) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, memo: &mut u32) {
        out.extend([b'r']);
        out.extend(memo.to_le_bytes());
        *memo += 1;
    }
    fn write(
        value: &Py,
        out: &mut Vec<u8>,
        memo: &mut u32,
        strings: &mut Vec<(&'static str, u32)>,
    ) {
        match value {
            Py::Int(n) => match i64::try_from(*n).unwrap() {
                n @ 0..=255 => out.extend([b'K', n as u8]),
                n @ 256..=65535 => {
                    out.push(b'M');
                    out.extend((n as u16).to_le_bytes());
                }
                n if i32::try_from(n).is_ok() => {
                    out.push(b'J');
                    out.extend((n as i32).to_le_bytes());
                }
                n => {
                    out.extend([0x8a, 8]);
                    out.extend(n.to_le_bytes());
                }
            },
            Py::Str(s) => match strings.iter().find(|(t, _)| t == s) {
                Some(&(_, id)) => {
                    out.push(b'j');
                    out.extend(id.to_le_bytes());
                }
                None => {
                    out.push(b'X');
                    out.extend((s.len() as u32).to_le_bytes());
                    out.extend(s.as_bytes());
                    strings.push((s, *memo));
                    put(out, memo);
                }
            },
            Py::List(items) => {
                out.extend([b']', b'(']);
                items.iter().for_each(|i| write(i, out, memo, strings));
                out.push(b'e');
                put(out, memo);
            }
            Py::Dict(pairs) => {
                out.extend([b'}', b'(']);
                for (k, v) in pairs {
                    write(&Py::Str(k), out, memo, strings);
                    write(v, out, memo, strings);
                }
                out.push(b'u');
                put(out, memo);
            }
            Py::Tuple(items) if items.len() == 2 => {
                items.iter().for_each(|i| write(i, out, memo, strings));
                out.push(0x86);
            }
            other => other.write(out),
        }
    }
    let mut out = vec![0x80, 2];
    write(value, &mut out, &mut 0, &mut Vec::new());
    out.push(b'.');
    out
}

#[test]
fn snapshot_pickles_of_every_writer_read_the_same() {
    let base = 0x7f12_3400_0000;
    let mut seg = segment(
        base,
        20 * MIB,
        false,
        vec![block(base, 20 * MIB, 0, "inactive")],
    );
    if let Py::Dict(pairs) = &mut seg {
        pairs.push(("segment_pool_id", Py::Tuple(vec![Py::int(0), Py::int(0)])));
    }
    let mut alloc = entry("alloc", base, 70_000);
    if let Py::Dict(pairs) = &mut alloc {
        pairs.push(("time_us", Py::Int(1_700_000_000_000_000)));
        pairs.push(("compile_context", Py::Str("N/A")));
        pairs.push(("user_metadata", Py::Str("")));
    }
    let value = snapshot(
        vec![seg],
        vec![alloc, entry("free_requested", base, 70_000)],
    );
    let expected = import("p4.pickle", &value.dump());
    assert_eq!(expected.devices[0].ops.len(), 3);
    // torch's C++ pickler (protocol 2).
    assert_eq!(import("p4.pickle", &dump_like_torch_jit(&value)), expected);
    // Python 3.8+ with protocol 5: PROTO 5, then one FRAME around the body.
    let body = &value.dump()[2..];
    let mut framed = vec![0x80, 5, 0x95];
    framed.extend((body.len() as u64).to_le_bytes());
    framed.extend(body);
    assert_eq!(import("p4.pickle", &framed), expected);
}

/// Python pickles `str` with `surrogatepass`: a lone surrogate in, say, a
/// frame's file name arrives as bytes that are not UTF-8.
#[test]
fn pickle_string_with_a_lone_surrogate_is_read() {
    let mut bytes = vec![0x80, 4, 0x8c, 5, b'a'];
    bytes.extend([0xed, 0xa0, 0x80]); // U+D800, surrogatepass-encoded
    bytes.extend([b'b', b'.']);
    let doc = pickle::parse(&bytes).unwrap();
    let Value::Str(text) = doc.get(doc.root()) else {
        panic!("not a str")
    };
    assert!(text.starts_with('a') && text.ends_with('b'), "{text:?}");
}

fn memory_event(ts: f64, addr: u64, bytes: i64, device_type: i64, device_id: i64) -> String {
    format!(
        r#"{{"ph": "i", "name": "[memory]", "ts": {ts}, "args": {{"Addr": {addr}, "Bytes": {bytes}, "Device Type": {device_type}, "Device Id": {device_id}}}}}"#
    )
}

/// A program profiled on the CPU: its host memory is the trace (device
/// -1), in timestamp order, with the time it spans and where its steps
/// (`ProfilerStep#N`) begin.
#[test]
fn chrome_trace_orders_by_timestamp_and_marks_steps() {
    let events = [
        memory_event(5.0, 16, 100, 0, -1),
        memory_event(9.0, 16, -100, 0, -1),
        memory_event(1.0, 32, 50, 0, -1),
        memory_event(2.0, 99, -7, 0, -1), // allocated before profiling
        memory_event(5.0, 48, 30, 0, -1), // same ts as the first: file order
        // Not a step, though it comes before the first op.
        r#"{"ph": "X", "name": "aten::add", "ts": 0.5}"#.to_string(),
        r#"{"ph": "X", "name": "ProfilerStep#1", "ts": 6, "dur": 4}"#.to_string(),
        r#"{"ph": "X", "name": "ProfilerStep#0", "ts": 4.5, "dur": 1}"#.to_string(),
    ];
    let json = format!(
        r#"{{"metadata": {{"workload": "test"}}, "traceEvents": [{}]}}"#,
        events.join(",")
    );
    let trace = import("profile.json", json.as_bytes());
    let devices: Vec<i64> = trace.devices.iter().map(|d| d.device).collect();
    assert_eq!(devices, vec![-1]);
    assert!(trace.notes.is_empty(), "{:?}", trace.notes);
    let cpu = &trace.devices[0];
    assert_eq!(cpu.recorded_span_us, Some(8));
    assert_eq!(
        cpu.step_starts,
        vec![1, 3],
        "the first ops at or after 4.5 and 6"
    );
    assert_eq!(
        cpu.ops,
        vec![
            Op::Alloc {
                id: 0,
                size: 50,
                stream: 0
            },
            Op::Alloc {
                id: 1,
                size: 100,
                stream: 0
            },
            Op::Alloc {
                id: 2,
                size: 30,
                stream: 0
            },
            Op::Free { id: 1 },
        ]
    );
    assert_eq!(cpu.skipped.get("free of an unknown address"), Some(&1));

    // The same trace gzipped reads the same.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, json.as_bytes()).unwrap();
    let gzipped = import("profile.json", &gz.finish().unwrap());
    assert_eq!(gzipped, trace);
}

#[test]
fn chrome_trace_alloc_at_a_live_address_frees_the_old_one() {
    let json = format!(
        "[{}, {}]",
        memory_event(1.0, 16, 100, 1, 0),
        memory_event(2.0, 16, 200, 1, 0)
    );
    let trace = import("reuse.json", json.as_bytes());
    assert_eq!(
        trace.devices[0].ops,
        vec![
            Op::Alloc {
                id: 0,
                size: 100,
                stream: 0
            },
            Op::Free { id: 0 },
            Op::Alloc {
                id: 1,
                size: 200,
                stream: 0
            },
        ]
    );
}

/// A zero-byte event allocates and frees nothing (the live block at its
/// address stays live), and a GPU's event must say which GPU.
#[test]
fn chrome_trace_skips_zero_byte_events_and_needs_a_gpus_device_id() {
    let json = format!(
        "[{}, {}, {}]",
        memory_event(1.0, 16, 100, 1, 0),
        memory_event(2.0, 16, 0, 1, 0),
        memory_event(3.0, 16, -100, 1, 0)
    );
    let trace = import("zero.json", json.as_bytes());
    let alloc = Op::Alloc {
        id: 0,
        size: 100,
        stream: 0,
    };
    assert_eq!(trace.devices[0].ops, vec![alloc, Op::Free { id: 0 }]);
    assert_eq!(trace.devices[0].skipped.get("zero-byte event"), Some(&1));
    assert_eq!(trace.devices[0].skipped.len(), 1);

    let no_id =
        r#"[{"name": "[memory]", "ts": 1, "args": {"Addr": 1, "Bytes": 8, "Device Type": 1}}]"#;
    let error = import_error(no_id.as_bytes());
    assert!(
        error.contains("traceEvents[0]: missing args.Device Id"),
        "{error}"
    );
    // On the CPU the id may be left out: it is host memory either way.
    let host = r#"[{"name": "[memory]", "ts": 1, "args": {"Addr": 1, "Bytes": 8}}]"#;
    assert_eq!(import("host.json", host.as_bytes()).devices[0].device, -1);
}

/// Only an address may be written past `i64::MAX` (a host pointer); a byte
/// count there is refused, not wrapped negative into a free of its address.
#[test]
fn chrome_trace_refuses_a_byte_count_past_64_signed_bits() {
    let huge = r#"{"name": "[memory]", "ts": 2, "args": {"Addr": 16, "Bytes": 18446744073709551615, "Device Type": 1, "Device Id": 0}}"#;
    let json = format!("[{}, {huge}]", memory_event(1.0, 16, 100, 1, 0));
    let error = import_error(json.as_bytes());
    assert!(
        error.contains("traceEvents[1]: args.Bytes is not an integer of 64 bits"),
        "{error}"
    );
    let device = r#"[{"name": "[memory]", "ts": 1, "args": {"Addr": 16, "Bytes": 8, "Device Type": 1, "Device Id": 18446744073709551615}}]"#;
    let error = import_error(device.as_bytes());
    assert!(
        error.contains("args.Device Id is not an integer"),
        "{error}"
    );
    let address = r#"[{"name": "[memory]", "ts": 1, "args": {"Addr": 18446744073709551615, "Bytes": 8, "Device Type": 1, "Device Id": 0}}]"#;
    assert_eq!(
        import("addr.json", address.as_bytes()).devices[0].ops.len(),
        1
    );
}

/// A GPU run: host and CUDA memory in one file (host memory left out with a
/// note, CUDA → its Device Id), an `[OutOfMemory]` event, Kineto's extra
/// top-level keys, `Addr` written as a signed `intptr_t`, and a `ts` given as
/// a string.
#[test]
fn chrome_trace_gpu_run_splits_devices_and_keeps_out_of_memory() {
    let events = [
        memory_event(1.0, 4096, 64, 0, -1),
        memory_event(2.0, 0x7f00_0000_0000, 512, 1, 0),
        memory_event(3.0, 0x7e00_0000_0000, 1024, 1, 1),
        r#"{"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[OutOfMemory]", "pid": 1, "tid": 1, "ts": 4.5, "args": {"Device Type": 1, "Device Id": 0, "Bytes": 1073741824, "Total Allocated": 512, "Total Reserved": 2097152}}"#.to_string(),
        r#"{"ph": "i", "name": "[memory]", "ts": "5.25", "args": {"Device Type": 0, "Device Id": -1, "Addr": -8, "Bytes": 16}}"#.to_string(),
        memory_event(6.0, 0x7f00_0000_0000, -512, 1, 0),
    ];
    let json = format!(
        r#"{{"schemaVersion": 1, "deviceProperties": [{{"id": 0, "name": "NVIDIA H100"}}], "distributedInfo": {{"rank": 0}}, "baseTimeNanoseconds": 1700000000000000000, "traceEvents": [{}], "traceName": "x.json"}}"#,
        events.join(",")
    );
    let trace = import("gpu.json", json.as_bytes());
    let devices: Vec<i64> = trace.devices.iter().map(|d| d.device).collect();
    assert_eq!(devices, vec![0, 1]);
    assert_eq!(
        trace.notes,
        vec!["host (CPU) memory left out: 2 allocations, not on a GPU".to_string()]
    );
    let alloc = |id, size| Op::Alloc {
        id,
        size,
        stream: 0,
    };
    assert_eq!(
        trace.devices[0].ops,
        vec![
            alloc(0, 512),
            Op::Oom {
                size: 1 << 30,
                stream: 0,
                device_free: 0
            },
            Op::Free { id: 0 },
        ]
    );
    assert_eq!(trace.devices[1].ops, vec![alloc(0, 1024)]);
    assert_eq!(trace.devices[0].recorded_span_us, Some(4));

    let bad_ts = r#"[{"name": "[memory]", "ts": "soon", "args": {"Addr": 1, "Bytes": 8}}]"#;
    assert!(import_error(bad_ts.as_bytes()).contains("traceEvents[0]: ts is not a number"));
}

/// A chrome trace recorded without `profile_memory=True` (or the legacy
/// profiler's bare array, which never has memory events) has nothing to replay.
#[test]
fn chrome_trace_without_memory_events_is_refused() {
    for json in [
        &br#"{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}"#[..],
        br#"[{"name": "aten::mm", "ph": "X", "ts": 1, "dur": 2, "tid": 1, "pid": "CPU functions", "args": {}}]"#,
        b"[]",
    ] {
        let message = import_error(json);
        assert!(
            message.contains("no [memory] events") && message.contains("profile_memory=True"),
            "{message}"
        );
    }
}

/// An RMM `allocate` as the importer reads it.
fn rmm_alloc(id: u64, size: u64, stream: u64) -> Op {
    Op::Alloc { id, size, stream }
}

/// An RMM `allocate failure`: RMM logs no free memory with it.
fn rmm_failure(size: u64, stream: u64) -> Op {
    Op::Oom {
        size,
        stream,
        device_free: 0,
    }
}

/// rapids-logger-era RMM (`%llx`) writes hex without `0x`, and a null
/// pointer as `0`; `rmm.reinitialize` names per-device logs `<name>.dev<N><ext>`.
#[test]
fn rmm_csv_bare_hex_and_device_from_the_file_name() {
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
               140,10:00:00.000001,allocate,7f0000000000,256,0\n\
               140,10:00:00.000002,allocate failure,0,1073741824,2\n\
               140,10:00:00.000003,free,7f0000000000,256,0\n";
    let trace = import("rmm_log.dev1.csv", csv.as_bytes());
    let device = &trace.devices[0];
    assert_eq!(device.device, 1);
    assert_eq!(
        device.ops,
        vec![
            rmm_alloc(0, 256, 0),
            rmm_failure(1 << 30, 2),
            Op::Free { id: 0 },
        ]
    );
    let device_of = |name| import(name, csv.as_bytes()).devices[0].device;
    assert_eq!(device_of("rmm_log.dev12.csv.gz"), 12);
    assert_eq!(device_of("rmm_log.dev3"), 3);
    assert_eq!(device_of("dev2.csv"), 0);
    assert_eq!(device_of("rmm_log.device.csv"), 0);
    assert_eq!(device_of("log.csv"), 0);
    // Ten digits is no device number RMM writes.
    assert_eq!(device_of("rmm_log.dev1234567890.csv"), 0);
}

#[test]
fn rmm_csv_parses_allocations_frees_and_failures() {
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
               140,10:00:00.000001,allocate,0x7f0000000000,256,0x0\n\
               140,10:00:00.000002,allocate,0x7f0000001000,512,0x5a\n\
               140,10:00:00.000003,free,0x7f0000000000,256,0x0\n\
               140,10:00:00.000004,allocate failure,0x0,1073741824,0x0\n\
               140,10:00:00.000005,free,0x1234,8,0x0\n";
    let trace = import("log.csv", csv.as_bytes());
    let device = &trace.devices[0];
    assert_eq!(device.device, 0);
    assert_eq!(
        device.ops,
        vec![
            rmm_alloc(0, 256, 0),
            rmm_alloc(1, 512, 0x5a),
            Op::Free { id: 0 },
            rmm_failure(1 << 30, 0),
        ]
    );
    assert_eq!(device.skipped.get("free of an unknown address"), Some(&1));
    assert_eq!(device.recorded_span_us, Some(4));
}

/// An allocation at a live address frees the old one first (RMM missed its
/// free), the log's time runs on past midnight, and a header with more
/// columns than RMM's is no RMM log.
#[test]
fn rmm_csv_reuses_a_live_address_and_spans_midnight() {
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
               1,23:59:59.500000,allocate,0x10,256,0x0\n\
               1,23:59:59:750000,allocate,0x10,512,0x0\n\
               1,00:00:01.25,free,0x10,512,0x0\n";
    let device = &import("log.csv", csv.as_bytes()).devices[0];
    assert_eq!(
        device.ops,
        vec![
            rmm_alloc(0, 256, 0),
            Op::Free { id: 0 },
            rmm_alloc(1, 512, 0),
            Op::Free { id: 1 },
        ]
    );
    assert_eq!(
        device
            .skipped
            .get("allocate at a live address (old one freed first)"),
        Some(&1)
    );
    assert_eq!(device.recorded_span_us, Some(1_750_000));
    let wider = "Thread,Time,Action,Pointer,Size,Stream,Extra\n1,10:00:00.0,free,0x10,8,0x0,x\n";
    let error = import_error(wider.as_bytes());
    assert!(
        error.contains("line 1") && error.contains("expected the header"),
        "{error}"
    );
}

// ---- Bad input: each error names the file, format, place and problem. ----

#[test]
fn refuses_a_global_with_a_one_line_message() {
    let error = parse_bytes("cs336.pickle", b"\x80\x02cos\nsystem\n)R.").unwrap_err();
    assert_eq!(
        error.to_string(),
        "cs336.pickle: pickle: byte 2: refused global 'os.system' (only plain data is accepted)"
    );
    let stack_global = b"\x80\x04\x8c\x02os\x8c\x06system\x93.";
    assert!(import_error(stack_global).contains("refused global 'os.system'"));
    // torch.save-style pickles name torch globals and persistent ids.
    let torch_global = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00.";
    assert!(import_error(torch_global).contains("refused global 'torch._utils._rebuild_tensor_v2'"));
    assert!(import_error(b"\x80\x02X\x01\x00\x00\x000Q.").contains("refused opcode BINPERSID"));
}

/// `value` as Python would print it, ids followed into the arena.
fn repr(doc: &pickle::Document, id: pickle::ValueId) -> String {
    let items = |ids: &[pickle::ValueId]| {
        ids.iter()
            .map(|&item| repr(doc, item))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match doc.get(id) {
        Value::None => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Int(n) => n.to_string(),
        Value::Float(x) => format!("{x:?}"),
        Value::Str(text) => format!("'{text}'"),
        Value::Bytes(bytes) => format!("b'{}'", String::from_utf8_lossy(bytes)),
        Value::List(ids) => format!("[{}]", items(ids)),
        Value::Tuple(ids) if ids.len() == 1 => format!("({},)", items(ids)),
        Value::Tuple(ids) => format!("({})", items(ids)),
        Value::Dict(pairs) => {
            let pairs: Vec<String> = pairs
                .iter()
                .map(|&(k, v)| format!("{}: {}", repr(doc, k), repr(doc, v)))
                .collect();
            format!("{{{}}}", pairs.join(", "))
        }
    }
}

/// Each data opcode the reader takes, on its own: what it builds.
#[test]
fn pickle_reads_every_data_opcode() {
    let cases: &[(&[u8], &str)] = &[
        (b"(K\x01K\x021K\x03.", "3"),                        // POP_MARK
        (b"]2K\x01a0.", "[1]"),                              // DUP: the same list
        (b"N\x88\x89\x87.", "(None, True, False)"),          // TUPLE3
        (b"J\xff\xff\xff\xffM\x01\x01\x86.", "(-1, 257)"),   // BININT, BININT2
        (b"G?\xe0\x00\x00\x00\x00\x00\x00\x85.", "(0.5,)"),  // BINFLOAT
        (b"U\x02ab.", "b'ab'"),                              // SHORT_BINSTRING
        (b"C\x02ab.", "b'ab'"),                              // SHORT_BINBYTES
        (b"B\x02\x00\x00\x00ab.", "b'ab'"),                  // BINBYTES
        (b"T\x02\x00\x00\x00ab.", "b'ab'"),                  // BINSTRING
        (b"\x8e\x01\x00\x00\x00\x00\x00\x00\x00a.", "b'a'"), // BINBYTES8
        (
            b"X\x01\x00\x00\x00a\x8d\x01\x00\x00\x00\x00\x00\x00\x00b\x86.",
            "('a', 'b')",
        ),
        (b"(\x8c\x01kK\x01d.", "{'k': 1}"), // DICT
        (b"(d.", "{}"),
        (b"(K\x01K\x02l.", "[1, 2]"),  // LIST
        (b"(K\x01K\x02t.", "(1, 2)"),  // TUPLE
        (b"}(u.", "{}"),               // SETITEMS of nothing
        (b"](K\x01K\x02e.", "[1, 2]"), // APPENDS
        // PUT and GET by text line, BINPUT and BINGET, LONG_BINPUT and
        // LONG_BINGET: two keys each, so that a key read wrong shows.
        (b"]p7\n0)p8\n0g7\n.", "[]"),
        (b"]q\x07\x30)q\x08\x30h\x07.", "[]"),
        (
            b"]r\x07\x00\x00\x000)r\x08\x00\x00\x000j\x07\x00\x00\x00.",
            "[]",
        ),
        // LONG1 of 16 bytes, the widest accepted.
        (
            b"\x8a\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01.",
            "1329227995784915872903807060280344576",
        ),
    ];
    for &(body, expected) in cases {
        let mut bytes = vec![0x80, 2];
        bytes.extend_from_slice(body);
        let doc = pickle::parse(&bytes).unwrap_or_else(|e| panic!("{expected}: {e}"));
        assert_eq!(repr(&doc, doc.root()), expected);
        assert!(!doc.is_empty());
        assert_eq!(doc.len(), doc.values().count());
    }
    for (body, message) in [
        (&b"T\xff\xff\xff\xff."[..], "negative length -1"),
        (b"(K\x01d.", "DICT with an odd number of items"),
        (b"}(K\x01u.", "SETITEMS with an odd number of items"),
        (b"]px\n.", "bad memo key \"x\""),
        (
            b"\x8a\x11\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01.",
            "integer of 17 bytes is too large",
        ),
    ] {
        let mut bytes = vec![0x80, 2];
        bytes.extend_from_slice(body);
        let error = import_error(&bytes);
        assert!(error.contains(message), "{error}");
    }
}

/// Every opcode that would call code or build an object is named.
#[test]
fn refuses_each_object_opcode_by_name() {
    for (opcode, name) in [
        (b'R', "REDUCE"),
        (b'b', "BUILD"),
        (b'o', "OBJ"),
        (0x81, "NEWOBJ"),
        (0x92, "NEWOBJ_EX"),
        (b'P', "PERSID"),
        (b'Q', "BINPERSID"),
        (0x82, "EXT1"),
        (0x83, "EXT2"),
        (0x84, "EXT4"),
        (0x97, "NEXT_BUFFER"),
        (0x98, "READONLY_BUFFER"),
    ] {
        let error = import_error(&[0x80, 5, opcode, b'.']);
        assert!(
            error.contains(&format!("refused opcode {name} ")),
            "{error}"
        );
    }
}

#[test]
fn refuses_object_building_opcodes() {
    assert!(import_error(b"\x80\x02N)R.").contains("refused opcode REDUCE"));
    assert!(import_error(b"\x80\x02})b.").contains("refused opcode BUILD"));
    assert!(import_error(b"\x80\x02N)\x81.").contains("refused opcode NEWOBJ"));
    assert!(import_error(b"\x80\x02(i os\nsystem\n.").contains("refused INST of"));
}

#[test]
fn reports_truncated_and_corrupt_pickles() {
    let valid = snapshot(vec![], vec![entry("alloc", 0x100, 8)]).dump();
    let message = import_error(&valid[..valid.len() / 2]);
    assert!(message.starts_with("bad.bin: pickle: byte "), "{message}");
    assert!(message.contains("truncated"), "{message}");
    assert!(import_error(b"\x80\x02\xff.").contains("unsupported opcode 0xff"));
    assert!(import_error(b"\x80\x02.").contains("stack underflow"));
    assert!(import_error(b"\x80\x02h\x05.").contains("memo key 5 was never stored"));
    assert!(import_error(b"\x80\x02]NK\x01s.").contains("SETITEM on a list, not a dict"));
}

#[test]
fn caps_declared_lengths_by_the_remaining_input() {
    for bytes in [
        &b"\x80\x04X\xff\xff\xff\xff"[..],
        b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\x7f",
        b"\x80\x04\x8b\xff\xff\xff\x7f",
    ] {
        let message = import_error(bytes);
        assert!(message.contains("remain"), "{message}");
    }
    assert!(import_error(b"\x80\x04\x8b\xff\xff\xff\xff").contains("negative length"));
}

#[test]
fn bounds_nesting_and_stack_depth() {
    let marks = [&b"\x80\x04"[..], &[b'('; 100_000]].concat();
    assert!(import_error(&marks).contains("nested MARKs"));
    let pushes = [&b"\x80\x04"[..], &[b']'; 2_000_000]].concat();
    assert!(import_error(&pushes).contains("stack deeper than"));
    // A million lists nested through the memo: decoded flat, no recursion,
    // then rejected because the root is not a snapshot dict.
    let mut nested = vec![0x80, 4, b']', b'r', 0, 0, 0, 0];
    for i in 0u32..1_000_000 {
        nested.push(b']');
        nested.push(b'j');
        nested.extend(i.to_le_bytes());
        nested.extend([b'a', b'r']);
        nested.extend((i + 1).to_le_bytes());
    }
    nested.push(b'.');
    // A root list is read as a list of segments; its item is not a dict.
    let message = import_error(&nested);
    assert!(
        message.contains("snapshot: [0]: expected a dict, found list"),
        "{message}"
    );
}

#[test]
fn refuses_a_trace_list_shared_by_many_devices() {
    // {"segments": [], "device_traces": [L, L, ..., L]} with L a list of 2000
    // entries memoized once: 2000 devices × 2000 entries from a small file.
    let mut bytes = vec![0x80, 4, b'}', b'('];
    Py::Str("segments").write(&mut bytes);
    bytes.push(b']');
    Py::Str("device_traces").write(&mut bytes);
    bytes.extend([b']', b']', b'r', 0, 0, 0, 0, b'(']);
    for _ in 0..2000 {
        entry("alloc", 0x100, 8).write(&mut bytes);
    }
    bytes.extend([b'e', b'a']);
    for _ in 0..2000 {
        bytes.extend([b'j', 0, 0, 0, 0, b'a']);
    }
    bytes.extend([b'u', b'.']);
    let started = std::time::Instant::now();
    let message = import_error(&bytes);
    assert!(message.contains("shared references"), "{message}");
    assert!(started.elapsed().as_secs() < 10);
}

#[test]
fn reports_wrong_types_by_path() {
    let segments_int = Py::Dict(vec![("segments", Py::int(3))]).dump();
    assert!(import_error(&segments_int).contains("segments: expected a list, found int"));
    let size_str = snapshot(
        vec![],
        vec![Py::Dict(vec![
            ("action", Py::Str("alloc")),
            ("addr", Py::int(1)),
            ("size", Py::Str("big")),
        ])],
    )
    .dump();
    let message = import_error(&size_str);
    assert!(
        message.contains("snapshot: device_traces[0][0].size: expected an integer, found str"),
        "{message}"
    );
    let no_addr = snapshot(vec![], vec![Py::Dict(vec![("action", Py::Str("alloc"))])]).dump();
    assert!(import_error(&no_addr).contains("device_traces[0][0]: missing 'addr'"));
}

#[test]
fn reports_bad_json_and_csv() {
    let message = import_error(b"{\"traceEvents\": [\n{\"name\": ");
    assert!(
        message.starts_with("bad.bin: chrome-trace: line 2"),
        "{message}"
    );
    let message = import_error(br#"{"traceEvents": [{"name": "[memory]", "args": {"Bytes": 8}}]}"#);
    assert!(
        message.contains("traceEvents[0]: missing args.Addr"),
        "{message}"
    );
    let csv = b"Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x10,8,0x0\n1,t,allocate,0x20,lots,0x0\n";
    assert_eq!(
        import_error(csv),
        "bad.bin: rmm-csv: line 3: bad size \"lots\""
    );
    assert!(import_error(b"hello").contains("unrecognized format"));
    assert!(import_error(b"\x1f\x8b\x08\x00garbage").contains("gzip"));
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_bytes("fuzz.bin", &bytes);
            let with_header = [&[0x80u8, 4][..], &bytes].concat();
            let _ = parse_bytes("fuzz.pickle", &with_header);
        }

        #[test]
        fn mutated_snapshots_never_panic(position in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = snapshot(
                vec![segment(0x1000, 2 * MIB, false, vec![block(0x1000, 512, 8, "active_allocated")])],
                vec![entry("free_requested", 0x1000, 8), entry("free_completed", 0x1000, 8)],
            )
            .dump();
            let at = position.index(bytes.len());
            bytes[at] = byte;
            let _ = parse_bytes("fuzz.pickle", &bytes);
        }
    }
}

/// A path that names no file says so with the path as given; a pattern the
/// shell did not expand (no file matched it) says that too.
#[test]
fn a_missing_file_is_named_and_an_unexpanded_pattern_is_told_apart() {
    let dir = std::env::temp_dir().join("hbmalloc-trace-no-such-dir");
    for (name, pattern) in [
        ("run.pickle", false),
        ("*.pickle", true),
        ("run?.json", true),
    ] {
        let path = dir.join(name);
        let message = hbmalloc_trace::load(&path).unwrap_err().to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert_eq!(
            message.contains("no file matches this pattern"),
            pattern,
            "{message}"
        );
    }
    // A path that exists but is no file is not a pattern, whatever its name.
    let odd = std::env::temp_dir().join(format!("hbmalloc-trace-[{}]", std::process::id()));
    std::fs::create_dir_all(&odd).unwrap();
    let message = hbmalloc_trace::load(&odd).unwrap_err().to_string();
    std::fs::remove_dir(&odd).unwrap();
    assert!(!message.contains("no file matches"), "{message}");
}
