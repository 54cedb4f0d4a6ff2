"""Sonar inside the training loops people already use (`pip install 'sonar-fx[hf]'`).

`sonar_fx.integrations.hf`: transformers' `Trainer` (`SonarTrainer`, `SonarTrainerMixin`, `sonar_config`,
`byte_tokenizer`); `sonar_fx.integrations.sft`: TRL's `SFTTrainer` (`SonarSFTTrainer`). Importing this
package imports neither transformers' Trainer nor TRL: each module is imported on its own.
"""
