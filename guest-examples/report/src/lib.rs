//! The `report` example: a multi-step job that checkpoints its progress
//! with ack-and-reschedule.
//!
//! Payload: `{"report_id": "r-1", "days": ["2026-11-01", "2026-11-02"],
//! "step": 0, "sales": 0, "total": 0, "pause_ms": 100}`.
//!
//! Each message is one step: it sums one day of `sales`, records the
//! progress in `reports`, and, in the same transaction as its ack,
//! enqueues the next step on its own queue (`Ctx::reschedule`) after
//! `pause_ms`. No step holds a lease for long, a crash repeats at most the
//! step in flight, and `reports` shows how far the job got. The last step
//! marks the report done and emits a `report-ready` intent keyed by the
//! report id.

use onceq_guest::{Ctx, Error, Handler, Message, Value};
use serde::{Deserialize, Serialize};

/// Rows of one day read per step (a larger day is an error).
const MAX_ROWS_PER_DAY: u32 = 1000;

#[derive(Serialize, Deserialize)]
struct Step {
    report_id: String,
    days: Vec<String>,
    #[serde(default)]
    step: usize,
    #[serde(default)]
    sales: i64,
    #[serde(default)]
    total: i64,
    #[serde(default = "default_pause")]
    pause_ms: u64,
}

fn default_pause() -> u64 {
    100
}

struct Report;

impl Handler for Report {
    fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error> {
        let mut job: Step = msg.json()?;
        if job.days.is_empty() {
            return Err(Error::reject(format!("report {}: no days to report on", job.report_id)));
        }
        let Some(day) = job.days.get(job.step).cloned() else {
            return Err(Error::reject(format!(
                "report {}: step {} is past the last day ({} days)",
                job.report_id,
                job.step,
                job.days.len()
            )));
        };
        // A step is never applied twice (its ack is in the same transaction),
        // but a report restarted by hand must not go backwards.
        if let Some(row) = ctx.get("reports", &[Value::from(job.report_id.as_str())])? {
            if row.i64("days_done")? > job.step as i64 {
                return Err(Error::reject(format!(
                    "report {}: step {} is already done",
                    job.report_id, job.step
                )));
            }
        }
        let rows = ctx.scan("sales", &[Value::from(day.as_str())], MAX_ROWS_PER_DAY + 1)?;
        if rows.len() > MAX_ROWS_PER_DAY as usize {
            return Err(Error::reject(format!(
                "report {}: day {day} has more than {MAX_ROWS_PER_DAY} sales",
                job.report_id
            )));
        }
        for r in &rows {
            job.total += r.i64("amount")?;
        }
        job.sales += rows.len() as i64;
        job.step += 1;
        let done = job.step == job.days.len();
        ctx.upsert(
            "reports",
            [
                ("id", Value::from(job.report_id.as_str())),
                ("days_done", Value::from(job.step as i64)),
                ("days_total", Value::from(job.days.len() as i64)),
                ("sales", Value::from(job.sales)),
                ("total", Value::from(job.total)),
                ("status", Value::from(if done { "done" } else { "running" })),
                ("updated_at", Value::Timestamp(msg.now)),
            ],
        );
        if done {
            ctx.intent(
                "report-ready",
                format!("report-{}", job.report_id),
                &serde_json::json!({ "report_id": job.report_id, "sales": job.sales, "total": job.total }),
            )
            .metadata("x-report-days", job.days.len().to_string());
        } else {
            let pause = job.pause_ms;
            ctx.reschedule(msg, pause, &job);
        }
        Ok(())
    }
}

onceq_guest::export_handler!(Report);
