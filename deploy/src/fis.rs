//! Spot interruptions on purpose, through AWS Fault Injection Service: an experiment whose
//! one action, `aws:ec2:send-spot-instance-interruptions`, gives chosen spot instances the
//! same two-minute interruption notice a real revocation does (through the instance metadata
//! service, where `limpetd` watches for it) and then interrupts them. What `limpet-lab chaos
//! --ec2` fires for a trace's removals with notice.
//!
//! FIS needs an IAM role it can assume with `ec2:SendSpotInstanceInterruptions` and
//! `ec2:DescribeInstances` on the targets (docs/operations.md). Its notice is 2 to 15
//! minutes: a compressed trace cannot shorten it.

use crate::{api_error, FleetConfig, FleetError};
use aws_sdk_fis::types::{
    CreateExperimentTemplateActionInput, CreateExperimentTemplateStopConditionInput,
    CreateExperimentTemplateTargetInput,
};
use std::time::Duration;

/// FIS's action that interrupts spot instances after a notice.
pub const SPOT_INTERRUPTION: &str = "aws:ec2:send-spot-instance-interruptions";

/// The notice FIS allows, seconds: at least 2 minutes, at most 15.
pub const NOTICE_RANGE_S: (u64, u64) = (120, 900);

/// A FIS client for one region.
#[derive(Clone, Debug)]
pub struct Fis {
    client: aws_sdk_fis::Client,
}

/// An experiment started: its id and the template it ran.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Started {
    /// FIS's experiment id.
    pub experiment: String,
    /// The experiment template made for it.
    pub template: String,
}

impl Fis {
    /// A client with `cfg`'s region, endpoint and credentials (else the SDK's defaults).
    pub async fn connect(cfg: &FleetConfig) -> Result<Fis, FleetError> {
        let shared = crate::sdk_config(cfg).await?;
        Ok(Fis { client: aws_sdk_fis::Client::new(&shared) })
    }

    /// The SDK client (tests read experiments back through it).
    pub fn client(&self) -> &aws_sdk_fis::Client {
        &self.client
    }

    /// Interrupts the spot instances `arns` after `notice` (clamped to FIS's 2 to 15
    /// minutes), assuming `role`; the template and experiment are tagged with `cluster`.
    /// `token` makes a retried request start one experiment, not two.
    pub async fn interrupt(
        &self,
        cluster: &str,
        arns: &[String],
        notice: Duration,
        role: &str,
        token: &str,
    ) -> Result<Started, FleetError> {
        if arns.is_empty() || arns.len() > 5 {
            return Err(FleetError::Usage(format!(
                "FIS interrupts 1 to 5 instances per target, not {}",
                arns.len()
            )));
        }
        if !role.starts_with("arn:") {
            return Err(FleetError::Usage(format!("--fis-role {role:?} is not an IAM role ARN")));
        }
        let secs = notice.as_secs().clamp(NOTICE_RANGE_S.0, NOTICE_RANGE_S.1);
        let usage = |e: aws_sdk_fis::error::BuildError| FleetError::Usage(e.to_string());
        let target = CreateExperimentTemplateTargetInput::builder()
            .resource_type("aws:ec2:spot-instance")
            .set_resource_arns(Some(arns.to_vec()))
            .selection_mode("ALL")
            .build()
            .map_err(usage)?;
        let action = CreateExperimentTemplateActionInput::builder()
            .action_id(SPOT_INTERRUPTION)
            .description("limpet chaos: a spot revocation with notice")
            .parameters("durationBeforeInterruption", format!("PT{secs}S"))
            .targets("SpotInstances", "Hosts")
            .build()
            .map_err(usage)?;
        let stop =
            CreateExperimentTemplateStopConditionInput::builder().source("none").build().map_err(usage)?;
        let template = self
            .client
            .create_experiment_template()
            .client_token(format!("{token}-template"))
            .description(format!("limpet chaos on {cluster}: interrupt {}", arns.join(" ")))
            .role_arn(role)
            .targets("Hosts", target)
            .actions("interrupt", action)
            .stop_conditions(stop)
            .tags("limpet:cluster", cluster)
            .send()
            .await
            .map_err(|e| api_error("CreateExperimentTemplate", e))?;
        let template_id = template
            .experiment_template()
            .and_then(|t| t.id())
            .ok_or_else(|| FleetError::Transport {
                op: "CreateExperimentTemplate",
                detail: "no template id in the answer".into(),
            })?
            .to_string();
        let started = self
            .client
            .start_experiment()
            .client_token(token)
            .experiment_template_id(&template_id)
            .tags("limpet:cluster", cluster)
            .send()
            .await
            .map_err(|e| api_error("StartExperiment", e))?;
        let experiment = started.experiment().and_then(|x| x.id()).unwrap_or_default().to_string();
        Ok(Started { experiment, template: template_id })
    }
}
