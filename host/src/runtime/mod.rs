//! The Wasm runtime: wasmtime's component model behind the [`Handler`] trait.
//!
//! - **Deploy-time checks** ([`Runtime::load`]): the bytes must be a
//!   component (not a core module), import only `onceq:handler/*` and the
//!   deterministic WASI subset ([`wasi`]), and export
//!   `onceq:handler/handler`. Every refusal names the problem.
//! - **Isolation**: a fresh instance per message, from a cached
//!   `InstancePre`, with the pooling allocator (so instantiation is cheap);
//!   no state leaks from one message to the next.
//! - **Limits**: a wall-clock deadline per call that holds whatever the
//!   guest does: an epoch deadline stops a guest that computes (a 10 ms
//!   ticker), and a timer around the whole call stops one blocked in a
//!   host call (a pollable, a long read); a linear-memory cap; a cap on the
//!   bytes it may log; and (in the protocol) bounds on its reads and
//!   effects. A trap, a deadline, a memory-limit hit or `exit` is a
//!   typed [`HandlerFailure`] with a reason — never a host crash; an
//!   instance the host could not make (descriptors or memory ran out) or a
//!   read the store did not answer in time is [`HostTrouble`], not the
//!   message's failure.
//! - **Export type check** at deploy: `handle` must have the signature of
//!   `wit/handler.wit`, not only the name, so a component built against
//!   another WIT is refused at `onceq check`/deploy, not at every message.

pub mod cache;
pub mod encoded;
pub mod wasi;

use crate::protocol::{HandleOutput, Handler, HandlerFailure, HostTrouble, ReadScope};
use crate::value::{self, Effect, Message};
use async_trait::async_trait;
use sha2::Digest;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, UpdateDeadline};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "queue-handler",
        imports: { default: async },
        exports: { default: async },
    });
}

use bindings::onceq::handler::types as wit;

/// Epoch tick period: deadlines are measured in these.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Engine-wide settings.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Instances that may be live at once (pooling allocator slots). 256
    /// by default: eight queues of a SQLite store at their default 32
    /// workers. A slot is address space reserved, not memory: an idle
    /// host's RSS was 42 MiB with 128 and with 256 (its virtual size 1
    /// and 2 TiB).
    pub max_instances: u32,
    /// Largest linear memory any handler may be given.
    pub max_memory: usize,
    /// Where compiled components are cached (wasmtime's serialized form,
    /// keyed by the component's SHA-256 and the engine's settings; see
    /// [`cache`]), so a restart or a redeploy of known bytes does not
    /// recompile. `None`: no cache.
    pub cache_dir: Option<std::path::PathBuf>,
    /// The cache folder's bound (`runtime.cache_max_bytes`): least recently
    /// used entries are removed past it.
    pub cache_max_bytes: u64,
    /// How a finished instance's memory is made fresh for the next one.
    /// `true` (default): the pages the instance dirtied are found with
    /// Linux's PAGEMAP_SCAN and only those copied back from the
    /// component's image or zeroed, up to [`KEEP_RESIDENT`] of them; the
    /// rest stay mapped, or are released past that budget. Where the scan
    /// is not available (not Linux, or a kernel before 6.7) memory is reset
    /// as with `false`.
    /// `false`: the first [`KEEP_RESIDENT_WHOLESALE`] bytes (all of a
    /// guest's memory, for the components measured) are copied back or
    /// zeroed whether dirtied or not, and stay mapped. Through `onceq run`
    /// the scan made JavaScript 2.0x and Python 1.65x faster than the
    /// wholesale reset, Rust the same (docs/src/benchmarks.md). It needs
    /// wasmtime 48.0.11: 48.0.8 stopped the scan after 32 runs of dirty
    /// pages and released everything past them, so interpreters faulted
    /// their heap in again on every message.
    pub reset_dirty_pages: bool,
    /// Count the instructions every call runs (wasmtime fuel), for
    /// `queue.max_instructions`, the per-version instruction metrics and
    /// the reports of `onceq try` and `onceq test`. On by default: `make
    /// bench` measured 1.02-1.09x the dispatch time and no difference in
    /// the pipeline; `runtime.count_instructions = false` saves that for
    /// handlers that compute a lot and need no budget.
    pub count_instructions: bool,
    /// Name every compiled function of every handler to `perf`
    /// (`runtime.perf_map`): wasmtime appends each one's address, size and
    /// name (`wasm[N]::function[M]::NAME`, from the component's name
    /// section) to `/tmp/perf-PID.map`, the file `perf report` reads for
    /// code it cannot find in a binary. Without it a guest's time shows
    /// as `[unknown]`. Off by default: the file grows with every component
    /// loaded and is not removed when the process exits. wasmtime writes a
    /// component's whole code once per core module: about 50 MB for a
    /// Python component (38 modules, 35,000 names).
    pub perf_map: bool,
}

/// Dirtied memory reset in place (and kept mapped) between instances with
/// `reset_dirty_pages`, the default; dirtied pages past it are released.
/// The payments components dirty less: Python and JavaScript ran as fast
/// through `onceq run` with 1, 8 and 32 MiB, with the least memory at 1.
pub const KEEP_RESIDENT: usize = 1 << 20;
/// Memory kept mapped, and reset wholesale, with `reset_dirty_pages =
/// false`: more than the whole memory of the JavaScript and Python
/// components measured, so their pages stay mapped between messages. A
/// reset copies or zeroes the guest's memory up to this size (a Rust
/// guest's is about a megabyte), not this size.
pub const KEEP_RESIDENT_WHOLESALE: usize = 32 << 20;

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            max_instances: 256,
            max_memory: 64 << 20,
            cache_dir: None,
            cache_max_bytes: cache::DEFAULT_MAX_BYTES,
            reset_dirty_pages: true,
            count_instructions: true,
            perf_map: false,
        }
    }
}

/// Per-handler limits.
#[derive(Debug, Clone, Copy)]
pub struct HandlerLimits {
    /// Wall-clock budget of one call (instantiation included).
    pub deadline: Duration,
    /// Linear memory cap, bytes.
    pub memory: usize,
    /// Bytes a call may write through the `log` import (`max_log_bytes`);
    /// past it, lines are dropped and one warning says so. stdout and
    /// stderr are captured up to [`wasi::STDIO_CAPACITY`] each.
    pub max_log_bytes: usize,
    /// Instructions one call may run, instantiation included
    /// (`queue.max_instructions`, wasmtime fuel): the same message fails
    /// the same way on any machine. `None`: no budget.
    pub max_instructions: Option<u64>,
}

impl Default for HandlerLimits {
    fn default() -> Self {
        HandlerLimits {
            deadline: Duration::from_secs(1),
            memory: 64 << 20,
            max_log_bytes: 1 << 20,
            max_instructions: None,
        }
    }
}

/// A refused component, with what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error("not a WebAssembly binary (no \\0asm header)")]
    NotWasm,
    #[error("this is a core WebAssembly module, not a component: build the handler for wasm32-wasip2 (or wrap it with `wasm-tools component new`)")]
    CoreModule,
    #[error("invalid component: {0}")]
    Invalid(String),
    #[error("the component imports interfaces a handler may not use: {}", .0.join(", "))]
    ForbiddenImports(Vec<String>),
    #[error("the component does not export onceq:handler/handler (it exports: {}); build it against wit/handler.wit, e.g. with onceq_guest::export_handler!", if .0.is_empty() { "nothing".to_string() } else { .0.join(", ") })]
    NoHandlerExport(Vec<String>),
    #[error("the component does not fit the onceq:handler world: {0}")]
    WrongWorld(String),
    #[error("the component's onceq:handler/handler export does not match wit/handler.wit: {0}; rebuild it against this onceq's WIT")]
    WrongSignature(String),
}

/// What `onceq check` prints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ComponentInfo {
    /// Content hash (sha256, first 16 hex digits).
    pub version: String,
    pub size: usize,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

struct EpochTicker {
    stop: Arc<AtomicBool>,
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Largest component file onceq reads (the Python runtime is ~19 MB).
pub const MAX_COMPONENT_BYTES: u64 = 256 << 20;

/// Read a component file: a regular file (a symlink to one is fine) of at
/// most [`MAX_COMPONENT_BYTES`]. A FIFO, a device (`/dev/zero`), a socket
/// or a folder is refused without reading it, so no such file can block
/// the host or its shutdown, or fill its memory.
pub fn read_component(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let not_regular = |meta: &std::fs::Metadata| {
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "a folder"
        } else {
            #[cfg(unix)]
            {
                use std::os::unix::fs::FileTypeExt;
                if ft.is_fifo() {
                    "a FIFO"
                } else if ft.is_char_device() || ft.is_block_device() {
                    "a device"
                } else if ft.is_socket() {
                    "a socket"
                } else {
                    "not a regular file"
                }
            }
            #[cfg(not(unix))]
            "not a regular file"
        };
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{kind}, not a component file"))
    };
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    // Opened without blocking, in case the file was replaced by a FIFO
    // since the check above; checked again on the open file.
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(0o4000); // O_NONBLOCK
    }
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let mut bytes = Vec::with_capacity(meta.len().min(MAX_COMPONENT_BYTES) as usize);
    file.take(MAX_COMPONENT_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_COMPONENT_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("larger than {} MiB, not a component file", MAX_COMPONENT_BYTES >> 20),
        ));
    }
    Ok(bytes)
}

/// The wasmtime engine and linker shared by every handler of a host.
pub struct Runtime {
    engine: Engine,
    linker: Arc<Linker<HostState>>,
    config: RuntimeConfig,
    cache: Option<cache::CodeCache>,
    _ticker: EpochTicker,
}

impl Runtime {
    pub fn new(config: RuntimeConfig) -> anyhow::Result<Runtime> {
        let mut pool = PoolingAllocationConfig::default();
        let n = config.max_instances.max(1);
        pool.total_component_instances(n)
            .total_core_instances(n * 48)
            .total_memories(n * 2)
            .total_tables(n * 48)
            .total_stacks(n)
            // Rust guests use a handful of core instances; componentize-py
            // components use 38 (measured), componentize-js ones more than 10.
            .max_core_instances_per_component(64)
            .max_memories_per_component(4)
            .max_tables_per_component(64)
            .max_memory_size(config.max_memory)
            .table_keep_resident(1 << 16);
        let scan = config.reset_dirty_pages && PoolingAllocationConfig::is_pagemap_scan_available();
        if config.reset_dirty_pages && !scan {
            // Without the scan wasmtime would reset the first
            // KEEP_RESIDENT bytes and release the rest, which an
            // interpreter faults in again on every message.
            tracing::info!(
                "runtime.reset_dirty_pages: this kernel has no PAGEMAP_SCAN (added in Linux 6.7); \
                 memory is reset wholesale"
            );
        }
        if scan {
            pool.linear_memory_keep_resident(KEEP_RESIDENT).pagemap_scan(wasmtime::Enabled::Yes);
        } else {
            pool.linear_memory_keep_resident(KEEP_RESIDENT_WHOLESALE)
                .pagemap_scan(wasmtime::Enabled::No);
        }
        let mut cfg = Config::new();
        cfg.wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(config.count_instructions)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        if config.perf_map {
            cfg.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&cfg).map_err(|e| anyhow::anyhow!("creating the wasmtime engine: {e}"))?;
        let cache = match &config.cache_dir {
            Some(dir) => Some(cache::CodeCache::open(dir, &engine, config.cache_max_bytes)?),
            None => None,
        };
        let mut linker = Linker::<HostState>::new(&engine);
        bindings::QueueHandler::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| anyhow::anyhow!("linking onceq:handler: {e}"))?;
        wasi::add_to_linker(&mut linker).map_err(|e| anyhow::anyhow!("linking the WASI subset: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("onceq-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| anyhow::anyhow!("starting the epoch ticker: {e}"))?;
        }
        Ok(Runtime {
            engine,
            linker: Arc::new(linker),
            config,
            cache,
            _ticker: EpochTicker { stop },
        })
    }

    /// Whether the component of SHA-256 `digest` ([`component_digest`]) is
    /// compiled already in the on-disk cache (loading it reads the
    /// compiled code).
    pub fn is_cached(&self, digest: &ComponentDigest) -> bool {
        self.cache.as_ref().is_some_and(|c| c.has(digest))
    }

    /// Check and compile a component whose [`component_digest`] is known,
    /// without preparing it for a queue (a component is hashed once per
    /// load: 12 ms for a 19 MB one).
    pub fn inspect_digested(&self, bytes: &[u8], digest: &ComponentDigest) -> Result<(Component, ComponentInfo), DeployError> {
        if bytes.len() < 8 || &bytes[0..4] != b"\0asm" {
            return Err(DeployError::NotWasm);
        }
        if bytes[4..8] == [1, 0, 0, 0] {
            return Err(DeployError::CoreModule);
        }
        let component = match &self.cache {
            Some(cache) => cache.component(&self.engine, bytes, digest),
            None => Component::new(&self.engine, bytes),
        }
        .map_err(|e| DeployError::Invalid(format!("{e:#}")))?;
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(&self.engine).map(|(n, _)| n.to_string()).collect();
        let exports: Vec<String> = ty.exports(&self.engine).map(|(n, _)| n.to_string()).collect();
        let version = version_of_digest(digest);
        Ok((
            component,
            ComponentInfo {
                version,
                size: bytes.len(),
                imports,
                exports,
            },
        ))
    }

    /// Validate, compile and prepare a handler component.
    pub fn load(&self, bytes: &[u8], limits: HandlerLimits) -> Result<WasmHandler, DeployError> {
        self.load_digested(bytes, &component_digest(bytes), limits)
    }

    /// [`Self::load`] of bytes whose [`component_digest`] is known.
    pub fn load_digested(&self, bytes: &[u8], digest: &ComponentDigest, limits: HandlerLimits) -> Result<WasmHandler, DeployError> {
        let (component, info) = self.inspect_digested(bytes, digest)?;
        self.prepare(component, info, limits)
    }

    /// [`Self::load`] of what [`Self::inspect_digested`] compiled (`onceq check`
    /// prints the component's imports and exports, then its verdict,
    /// compiling it once).
    pub fn prepare(&self, component: Component, info: ComponentInfo, limits: HandlerLimits) -> Result<WasmHandler, DeployError> {
        let forbidden = wasi::check_imports(info.imports.iter().map(String::as_str));
        if !forbidden.is_empty() {
            return Err(DeployError::ForbiddenImports(forbidden));
        }
        if !info.exports.iter().any(|e| wasi::unversioned(e) == "onceq:handler/handler") {
            return Err(DeployError::NoHandlerExport(info.exports));
        }
        self.check_export_types(&component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| DeployError::WrongWorld(format!("{e:#}")))?;
        let pre = bindings::QueueHandlerPre::new(pre).map_err(|e| DeployError::WrongWorld(format!("{e:#}")))?;
        let limits = HandlerLimits {
            memory: limits.memory.min(self.config.max_memory),
            ..limits
        };
        if limits.max_instructions.is_some() && !self.config.count_instructions {
            return Err(DeployError::Invalid(
                "the queue has an instruction budget but this runtime does not count instructions (runtime.count_instructions)".into(),
            ));
        }
        Ok(WasmHandler {
            pre,
            version: info.version,
            limits,
            counted: self.config.count_instructions,
        })
    }

    /// Type-check the `handle` export against the host's bindings (the same
    /// check wasmtime makes when an instance is loaded, made once here).
    /// `instance_type` is wasmtime's hidden API for exactly this; wasmtime
    /// is pinned, and `tests/hostile.rs` fails if the check stops working.
    fn check_export_types(&self, component: &Component) -> Result<(), DeployError> {
        use wasmtime::component::types::ComponentItem;
        let ty = component.component_type();
        let Some((name, ComponentItem::ComponentInstance(inst))) = ty
            .exports(&self.engine)
            .map(|(n, e)| (n, e.ty))
            .find(|(n, _)| wasi::unversioned(n) == "onceq:handler/handler")
        else {
            return Err(DeployError::WrongSignature("onceq:handler/handler is not an instance".into()));
        };
        let Some(ComponentItem::ComponentFunc(func)) = inst.get_export(&self.engine, "handle").map(|e| e.ty) else {
            return Err(DeployError::WrongSignature(format!("{name} has no function named handle")));
        };
        type Params = (wit::Message,);
        type Results = (Result<Vec<wit::Effect>, wit::HandlerError>,);
        func.typecheck::<Params, Results>(&ty.instance_type()).map_err(|e| {
            let params: Vec<String> = func.params().map(|(n, t)| format!("{n}: {}", type_name(&t))).collect();
            let results: Vec<String> = func.results().map(|t| type_name(&t)).collect();
            DeployError::WrongSignature(format!(
                "handle is func({}) -> {} ({e:#}); expected func(msg: message) -> result<list<effect>, handler-error>",
                params.join(", "),
                if results.is_empty() { "()".to_string() } else { results.join(", ") }
            ))
        })
    }

    /// [`Self::load_file`], saying through `progress` when a large
    /// component is about to be loaded (the first load of a 12-20 MB
    /// JavaScript or Python component compiles for seconds) and how long a
    /// slow load took, so a command never sits silent.
    pub fn load_file_reporting(
        &self,
        path: &std::path::Path,
        limits: HandlerLimits,
        progress: &dyn Fn(&str),
    ) -> anyhow::Result<WasmHandler> {
        let started = std::time::Instant::now();
        let bytes = read_component(path).map_err(|e| anyhow::anyhow!("reading handler {}: {e}", path.display()))?;
        let digest = component_digest(&bytes);
        if !self.is_cached(&digest) {
            announce_large(path, progress);
        }
        let handler = self
            .load_digested(&bytes, &digest, limits)
            .map_err(|e| anyhow::anyhow!("handler {} refused: {e}", path.display()))?;
        let took = started.elapsed();
        if took > std::time::Duration::from_secs(2) {
            progress(&format!("compiled {} in {:.1} s", path.display(), took.as_secs_f64()));
        }
        Ok(handler)
    }

    /// Load a handler from a file, naming the file in errors.
    pub fn load_file(&self, path: &std::path::Path, limits: HandlerLimits) -> anyhow::Result<WasmHandler> {
        let bytes = read_component(path).map_err(|e| anyhow::anyhow!("reading handler {}: {e}", path.display()))?;
        self.load(&bytes, limits)
            .map_err(|e| anyhow::anyhow!("handler {} refused: {e}", path.display()))
    }

    /// Refuse a configuration whose workers could exhaust the instance pool
    /// (each worker holds one live instance at a time).
    pub fn check_capacity(&self, workers: usize) -> anyhow::Result<()> {
        if workers as u64 > u64::from(self.config.max_instances) {
            anyhow::bail!(
                "{workers} workers need up to {workers} live instances, over runtime.max_instances = {}: raise it or use fewer workers",
                self.config.max_instances
            );
        }
        Ok(())
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

/// Components past this size take seconds to compile: say so first.
pub const LARGE_COMPONENT: u64 = 4 << 20;

/// Tell `progress` that `path` is large and its first load compiles it.
pub fn announce_large(path: &std::path::Path, progress: &dyn Fn(&str)) {
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    if size > LARGE_COMPONENT {
        progress(&format!(
            "loading {} ({:.1} MB; the first load compiles it, which can take a while; later runs read the compiled cache)",
            path.display(),
            size as f64 / (1 << 20) as f64
        ));
    }
}

/// A short name for a component-model type, for error messages.
fn type_name(t: &wasmtime::component::Type) -> String {
    use wasmtime::component::Type;
    match t {
        Type::String => "string".into(),
        Type::List(l) => format!("list<{}>", type_name(&l.ty())),
        Type::Record(_) => "record".into(),
        Type::Variant(_) => "variant".into(),
        Type::Result(_) => "result".into(),
        Type::Option(o) => format!("option<{}>", type_name(&o.ty())),
        Type::Tuple(_) => "tuple".into(),
        other => format!("{other:?}").to_lowercase().chars().take(24).collect(),
    }
}

/// A component's SHA-256: what names its version and its compiled-cache
/// entry.
pub type ComponentDigest = [u8; 32];

/// The SHA-256 of a component's bytes.
pub fn component_digest(bytes: &[u8]) -> ComponentDigest {
    sha2::Sha256::digest(bytes).into()
}

/// The version a component of this digest is known by: the first 8 bytes
/// of its SHA-256, in hex.
pub fn version_of_digest(digest: &ComponentDigest) -> String {
    crate::names::hex(&digest[..8])
}

/// Caps one store's memories, tables and instances, and remembers whether
/// the memory cap was what stopped the guest.
pub struct Limiter {
    memory: usize,
    memory_hit: bool,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory {
            self.memory_hit = true;
            return Err(wasmtime::Error::msg(format!(
                "memory limit of {} bytes exceeded (growing from {current} to {desired} bytes)",
                self.memory
            )));
        }
        Ok(true)
    }
    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
    // componentize-py components instantiate 38 core instances.
    fn instances(&self) -> usize {
        64
    }
    fn tables(&self) -> usize {
        128
    }
    fn memories(&self) -> usize {
        8
    }
}

/// The per-message store state.
pub struct HostState {
    wasi: wasi::DeterministicWasi,
    table: ResourceTable,
    limiter: Limiter,
    scope: ReadScope,
    ticks: u64,
    deadline_ticks: u64,
    timed_out: bool,
    /// Fuel given to the call, when instructions are counted.
    fuel: Option<u64>,
    /// Bytes logged through the `log` import so far, and the cap.
    log_bytes: usize,
    max_log_bytes: usize,
}

impl wasmtime_wasi::WasiView for HostState {
    fn ctx(&mut self) -> wasmtime_wasi::WasiCtxView<'_> {
        wasmtime_wasi::WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.table,
        }
    }
}

impl wit::Host for HostState {}

fn value_from_wit(v: wit::Value) -> value::Value {
    match v {
        wit::Value::Null => value::Value::Null,
        wit::Value::Boolean(b) => value::Value::Bool(b),
        wit::Value::Int64(i) => value::Value::Int64(i),
        wit::Value::Float64(f) => value::Value::Float64(f),
        wit::Value::Text(s) => value::Value::String(s),
        wit::Value::Bytes(b) => value::Value::Bytes(b),
        wit::Value::Json(s) => value::Value::Json(s),
        wit::Value::Timestamp(t) => value::Value::Timestamp(t),
    }
}

fn value_to_wit(v: value::Value) -> wit::Value {
    match v {
        value::Value::Null => wit::Value::Null,
        value::Value::Bool(b) => wit::Value::Boolean(b),
        value::Value::Int64(i) => wit::Value::Int64(i),
        value::Value::Float64(f) => wit::Value::Float64(f),
        value::Value::String(s) => wit::Value::Text(s),
        value::Value::Bytes(b) => wit::Value::Bytes(b),
        value::Value::Json(s) => wit::Value::Json(s),
        value::Value::Timestamp(t) => wit::Value::Timestamp(t),
    }
}

fn row_to_wit(r: value::Row) -> Vec<wit::Column> {
    r.into_iter()
        .map(|(name, v)| wit::Column {
            name,
            value: value_to_wit(v),
        })
        .collect()
}

fn columns_from_wit(cols: Vec<wit::Column>) -> Vec<(String, value::Value)> {
    cols.into_iter().map(|c| (c.name, value_from_wit(c.value))).collect()
}

fn effect_from_wit(e: wit::Effect) -> Effect {
    match e {
        wit::Effect::Write(w) => Effect::Write(value::RowWrite {
            table: w.table,
            op: match w.op {
                wit::WriteOp::Insert => value::WriteOp::Insert,
                wit::WriteOp::Update => value::WriteOp::Update,
                wit::WriteOp::Upsert => value::WriteOp::Upsert,
                wit::WriteOp::Delete => value::WriteOp::Delete,
            },
            columns: columns_from_wit(w.columns),
        }),
        wit::Effect::Enqueue(f) => Effect::Enqueue(value::FollowUp {
            queue: f.queue,
            payload: f.payload,
            attributes: f.attributes,
            delay_ms: f.delay_ms,
            dedup_key: f.dedup_key,
        }),
        wit::Effect::Intent(i) => Effect::Intent(value::Intent {
            connector: i.connector,
            idempotency_key: i.idempotency_key,
            payload: i.payload,
            metadata: i.metadata,
        }),
    }
}

impl bindings::onceq::handler::store::Host for HostState {
    async fn get(&mut self, table: String, key: Vec<wit::Value>) -> Result<Option<Vec<wit::Column>>, String> {
        let key: Vec<value::Value> = key.into_iter().map(value_from_wit).collect();
        // The WIT's error is text: the edge.
        self.scope
            .get(&table, &key)
            .await
            .map(|r| r.map(row_to_wit))
            .map_err(|e| e.to_string())
    }

    async fn scan(&mut self, table: String, prefix: Vec<wit::Value>, limit: u32) -> Result<Vec<Vec<wit::Column>>, String> {
        let prefix: Vec<value::Value> = prefix.into_iter().map(value_from_wit).collect();
        self.scope
            .scan(&table, &prefix, limit)
            .await
            .map(|rows| rows.into_iter().map(row_to_wit).collect())
            .map_err(|e| e.to_string())
    }
}

/// The same reads and effects as JSON text ([`encoded`]): decoded here,
/// then checked by the scope and the protocol as the typed ones are.
impl bindings::onceq::handler::encoded::Host for HostState {
    async fn emit(&mut self, effects: Vec<u8>) -> Result<(), String> {
        self.scope.emit(|room, limit| encoded::decode_effects(&effects, room, limit))
    }

    async fn get(&mut self, query: Vec<u8>) -> Result<Option<String>, String> {
        let (table, key) = encoded::decode_get(&query).map_err(|e| self.scope.refuse_malformed(e))?;
        self.scope
            .get(&table, &key)
            .await
            .map(|r| r.as_ref().map(encoded::encode_row))
            .map_err(|e| e.to_string())
    }

    async fn scan(&mut self, query: Vec<u8>) -> Result<String, String> {
        let (table, prefix, limit) = encoded::decode_scan(&query).map_err(|e| self.scope.refuse_malformed(e))?;
        self.scope
            .scan(&table, &prefix, limit)
            .await
            .map(|rows| encoded::encode_rows(&rows))
            .map_err(|e| e.to_string())
    }
}

impl bindings::onceq::handler::log::Host for HostState {
    async fn log(&mut self, level: bindings::onceq::handler::log::Level, message: String) {
        use bindings::onceq::handler::log::Level;
        let Some(message) = self.admit_log(message) else {
            return;
        };
        self.scope.note_log(
            match level {
                Level::Trace => "trace",
                Level::Debug => "debug",
                Level::Info => "info",
                Level::Warn => "warn",
                Level::Error => "error",
            },
            &message,
        );
        match level {
            Level::Trace => tracing::trace!(target: "onceq::guest", "{message}"),
            Level::Debug => tracing::debug!(target: "onceq::guest", "{message}"),
            Level::Info => tracing::info!(target: "onceq::guest", "{message}"),
            Level::Warn => tracing::warn!(target: "onceq::guest", "{message}"),
            Level::Error => tracing::error!(target: "onceq::guest", "{message}"),
        }
    }
}

impl HostState {
    /// Count a log line against `max_log_bytes`: `None` once over (one
    /// warning says so), else the line with control characters escaped so
    /// a guest cannot drive the operator's terminal.
    fn admit_log(&mut self, message: String) -> Option<String> {
        if self.log_bytes > self.max_log_bytes {
            return None;
        }
        self.log_bytes = self.log_bytes.saturating_add(message.len());
        if self.log_bytes > self.max_log_bytes {
            tracing::warn!(
                target: "onceq::guest",
                "guest log over {} bytes in one call (setting max_log_bytes): further lines of this call dropped",
                self.max_log_bytes
            );
            return None;
        }
        Some(crate::names::printable(&message))
    }
}

/// A handler component ready to run: one fresh instance per message.
pub struct WasmHandler {
    pre: bindings::QueueHandlerPre<HostState>,
    version: String,
    limits: HandlerLimits,
    /// The engine counts instructions (fuel).
    counted: bool,
}

impl WasmHandler {
    pub fn limits(&self) -> HandlerLimits {
        self.limits
    }

    fn new_store(&self, msg: &Message, scope: ReadScope) -> Store<HostState> {
        let engine = self.pre.engine();
        let deadline_ticks = (self.limits.deadline.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64;
        let state = HostState {
            wasi: wasi::DeterministicWasi::new(msg.logical_now(), msg.seed()),
            table: ResourceTable::new(),
            limiter: Limiter {
                memory: self.limits.memory,
                memory_hit: false,
            },
            scope,
            ticks: 0,
            deadline_ticks,
            timed_out: false,
            fuel: None,
            log_bytes: 0,
            max_log_bytes: self.limits.max_log_bytes,
        };
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        if self.counted {
            let fuel = self.limits.max_instructions.unwrap_or(u64::MAX);
            // Only fails on an engine that does not count, checked above.
            if store.set_fuel(fuel).is_ok() {
                store.data_mut().fuel = Some(fuel);
            }
        }
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|mut ctx| {
            let s = ctx.data_mut();
            s.ticks += 1;
            if s.ticks >= s.deadline_ticks {
                s.timed_out = true;
                Ok(UpdateDeadline::Interrupt)
            } else {
                // Let other tasks run while a long handler computes.
                Ok(UpdateDeadline::Yield(1))
            }
        });
        store
    }

    async fn call(&self, store: &mut Store<HostState>, msg: &Message) -> Result<Result<Vec<wit::Effect>, wit::HandlerError>, CallError> {
        let instance = self.pre.instantiate_async(&mut *store).await.map_err(CallError::Instantiate)?;
        let m = wit::Message {
            id: msg.id.clone(),
            queue: msg.queue.clone(),
            payload: msg.payload.clone(),
            // The host's provenance (onceq.*) is not the handler's: it sees
            // the attributes its producer set, so forwarding them into a
            // follow-up is never refused as forging provenance.
            attributes: msg
                .attributes
                .iter()
                .filter(|(k, _)| !crate::names::is_reserved(k))
                .cloned()
                .collect(),
            attempt: msg.attempt,
            enqueued_at: msg.enqueued_at,
            now: msg.logical_now(),
            seed: msg.seed(),
        };
        instance
            .onceq_handler_handler()
            .call_handle(&mut *store, &m)
            .await
            .map_err(CallError::Call)
    }
}

/// How a call of the handler failed.
enum CallError {
    /// The instance could not be made: a component that passed its deploy
    /// checks fails here only for want of the host's resources
    /// (descriptors, memory, instance slots), or its memory limit.
    Instantiate(wasmtime::Error),
    /// The guest trapped, exited or was stopped.
    Call(wasmtime::Error),
    /// The deadline passed while the guest waited in a host call.
    Waited,
}

/// Log captured guest output inside the message's span; return the last
/// stderr line (a Rust panic message lands there). When the call trapped,
/// that line goes into the failure's reason, which is reported anyway: the
/// stderr lines are then logged at debug, so a panic is not shown twice
/// (`onceq test`, `onceq run`'s warning).
fn drain_stdio(wasi: &wasi::DeterministicWasi, trapped: bool) -> Option<String> {
    let out = wasi.stdout.contents();
    for line in String::from_utf8_lossy(&out).lines().filter(|l| !l.is_empty()) {
        tracing::info!(target: "onceq::guest", stream = "stdout", "{}", crate::names::printable(line));
    }
    let err = wasi.stderr.contents();
    let text = String::from_utf8_lossy(&err);
    for line in text.lines().filter(|l| !l.is_empty()) {
        if trapped {
            tracing::debug!(target: "onceq::guest", stream = "stderr", "{}", crate::names::printable(line));
        } else {
            tracing::info!(target: "onceq::guest", stream = "stderr", "{}", crate::names::printable(line));
        }
    }
    guest_complaint(&text).map(|l| crate::names::truncated(&l, 1024))
}

/// What a guest said last on stderr before failing: a Rust panic as
/// "MESSAGE, at FILE:LINE:COL", else its last line.
fn guest_complaint(stderr: &str) -> Option<String> {
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let last = lines.iter().rposition(|l| !l.starts_with("note:"))?;
    // "thread '<unnamed>' panicked at src/lib.rs:52:23:" then the message.
    let panic = lines[..=last].iter().rposition(|l| l.contains(" panicked at ") && l.ends_with(':'));
    if let Some(at) = panic {
        let location = lines[at].split(" panicked at ").nth(1).unwrap_or("").trim_end_matches(':');
        let message = lines[at + 1..=last].join(" ");
        if !message.is_empty() {
            return Some(format!("{message}, at {location}"));
        }
    }
    Some(lines[last].to_string())
}

/// Said after a trap the guest explained nowhere: how a JavaScript or
/// Python component ends when it calls what the sandbox does not offer.
const UNEXPLAINED_TRAP: &str = "a component built with stubbed capabilities (JavaScript, or Python with --stub-wasi) \
ends this way when it calls what the sandbox does not offer, such as fetch(), a socket or open(): \
read rows through ctx.get/scan and reach other systems with an intent, delivered through the outbox";

#[async_trait]
impl Handler for WasmHandler {
    fn version(&self) -> &str {
        &self.version
    }

    async fn handle(&self, msg: &Message, scope: ReadScope) -> HandleOutput {
        let mut store = self.new_store(msg, scope);
        // The epoch deadline stops a guest that computes; this timer stops
        // one that waits in a host call (a pollable, a slow read), which the
        // epoch does not see. Dropping the call cancels the guest; its store
        // is dropped below, never reused. The timer gets one tick more, so a
        // computing guest is named by the epoch (with its stack) first.
        let r = match tokio::time::timeout(self.limits.deadline + EPOCH_TICK, self.call(&mut store, msg)).await {
            Ok(r) => r,
            Err(_) => {
                store.data_mut().timed_out = true;
                Err(CallError::Waited)
            }
        };
        let used = match store.data().fuel {
            Some(given) => store.get_fuel().ok().map(|left| given.saturating_sub(left)),
            None => None,
        };
        let mut state = store.into_data();
        state.scope.instructions = used;
        let out_of_fuel = |e: &wasmtime::Error| matches!(e.downcast_ref::<wasmtime::Trap>(), Some(wasmtime::Trap::OutOfFuel));
        let trapped = matches!(&r, Err(CallError::Call(e)) if e.downcast_ref::<wasmtime_wasi::I32Exit>().is_none())
            && !state.timed_out
            && !state.limiter.memory_hit;
        let last_stderr = drain_stdio(&state.wasi, trapped);
        let result = match r {
            Ok(Ok(effects)) => {
                // Those emitted during the call come first.
                let mut all = std::mem::take(&mut state.scope.emitted);
                all.extend(effects.into_iter().map(effect_from_wit));
                Ok(all)
            }
            Ok(Err(wit::HandlerError::Retry(r))) => Err(HandlerFailure::from_retry(r.reason, r.delay_ms.map(Duration::from_millis))),
            Ok(Err(wit::HandlerError::Reject(reason))) => Err(HandlerFailure::Reject(reason)),
            // A read the store did not answer in time: the store's
            // trouble, not the handler's.
            Err(CallError::Waited) if state.scope.reading => Err(HandlerFailure::Host(HostTrouble::ReadStalled(self.limits.deadline))),
            Err(CallError::Waited) => Err(HandlerFailure::Deadline(self.limits.deadline)),
            Err(CallError::Instantiate(_)) if state.limiter.memory_hit => Err(HandlerFailure::Memory(self.limits.memory)),
            Err(CallError::Instantiate(e) | CallError::Call(e)) if out_of_fuel(&e) => {
                Err(HandlerFailure::Instructions(self.limits.max_instructions.unwrap_or(u64::MAX)))
            }
            // A start function that traps is the component's own doing.
            Err(CallError::Instantiate(e)) if e.downcast_ref::<wasmtime::Trap>().is_some() => {
                Err(HandlerFailure::Crash(format!("trap while starting the instance: {e:#}")))
            }
            Err(CallError::Instantiate(e)) => Err(HandlerFailure::Host(HostTrouble::Resources(format!("{e:#}")))),
            Err(CallError::Call(_)) if state.timed_out => Err(HandlerFailure::Deadline(self.limits.deadline)),
            Err(CallError::Call(_)) if state.limiter.memory_hit => Err(HandlerFailure::Memory(self.limits.memory)),
            Err(CallError::Call(e)) => match e.downcast_ref::<wasmtime_wasi::I32Exit>() {
                Some(exit) => Err(HandlerFailure::Exit(exit.0)),
                None => {
                    let mut reason = match e.downcast_ref::<wasmtime::Trap>() {
                        Some(trap) => format!("trap: {trap}"),
                        None => format!("{e:#}"),
                    };
                    match last_stderr {
                        Some(line) => reason.push_str(&format!(" (guest stderr: {line})")),
                        None if matches!(e.downcast_ref::<wasmtime::Trap>(), Some(wasmtime::Trap::UnreachableCodeReached)) => {
                            reason.push_str(&format!(" ({UNEXPLAINED_TRAP})"))
                        }
                        None => {}
                    }
                    Err(HandlerFailure::Crash(reason))
                }
            },
        };
        HandleOutput {
            scope: state.scope,
            result,
        }
    }
}

#[cfg(test)]
mod complaint_tests {
    #![allow(clippy::unwrap_used)]
    use super::guest_complaint;

    #[test]
    fn a_rust_panic_is_named_with_its_location() {
        let stderr = "\nthread '<unnamed>' panicked at src/lib.rs:52:23:\nchaos: asked to trap\nnote: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n";
        assert_eq!(guest_complaint(stderr).unwrap(), "chaos: asked to trap, at src/lib.rs:52:23");
        assert_eq!(
            guest_complaint("first\nUncaught TypeError: x is null\n").unwrap(),
            "Uncaught TypeError: x is null"
        );
        assert_eq!(guest_complaint("note: only a note\n"), None);
        assert_eq!(guest_complaint(""), None);
    }
}
